"""Speculation counters of one benchmark run of our server, read from its /health (issue 38).

`/health` carries `speculative`: the mode, `drafted_tokens` and `accepted_tokens` since start
and, where the server reports it, `cost_model` (the spec policy's fit a, r, d, c in ms and each
drafting source's acceptance rate). `snapshot` reads it; `delta` gives what one load added, so
each run's row says how many draft ids were verified and kept while it was measured.
"""

from __future__ import annotations

import contextlib

import httpx


def snapshot(url: str) -> dict | None:
    """The server's `speculative` block, or None (a peer, or /health did not answer)."""
    with (
        contextlib.suppress(httpx.HTTPError, ValueError),
        httpx.Client(trust_env=False, timeout=5.0) as client,
    ):
        block = client.get(f"{url}/health").json().get("speculative")
        return block if isinstance(block, dict) else None
    return None


def delta(before: dict | None, after: dict | None) -> dict:
    """The run's draft counts (and the cost model after it): {} when either read failed."""
    if not before or not after:
        return {}
    drafted = after.get("drafted_tokens", 0) - before.get("drafted_tokens", 0)
    accepted = after.get("accepted_tokens", 0) - before.get("accepted_tokens", 0)
    out = {
        "speculative": after.get("mode"),
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "draft_acceptance": accepted / drafted if drafted else None,
    }
    if after.get("cost_model") is not None:
        out["spec_cost_model"] = after["cost_model"]
    return out
