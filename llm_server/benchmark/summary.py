"""Turn raw load results into the numbers the report shows (plain dicts, JSON-ready).

Units: seconds for latency and TTFT, milliseconds for time per output token, bytes for memory.
Percentiles interpolate linearly between samples (numpy's default).
"""

from __future__ import annotations

import numpy as np

from llm_server.benchmark.load import LoadResult
from llm_server.benchmark.memory import MemorySample


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize_load(result: LoadResult, warm: MemorySample, after: MemorySample) -> dict:
    """Throughput, latency, TTFT, time per output token and memory of one load run.

    `warm` is read after the warm-up, before the load; `after` once the load has finished and
    the server sat idle briefly. The peak is the kernel's high-water mark over the process life.
    """
    ok = [r for r in result.records if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    lat = [r.latency_s for r in ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    # Time per output token: the decode part of a request over the tokens after the first.
    tpot = [
        (r.latency_s - r.ttft_s) / (r.completion_tokens - 1) * 1000.0
        for r in ok
        if r.ttft_s is not None and r.completion_tokens > 1
    ]
    # Inter-token gaps: between consecutive content deltas of one stream (a delta is one token
    # unless text was held back), so an admission that stalls the batch shows in the tail.
    gaps = [(b - a) * 1000.0 for r in ok for a, b in zip(r.chunk_s, r.chunk_s[1:], strict=False)]
    itl50, itl99 = _pct(gaps, 50), _pct(gaps, 99)
    return {
        "concurrency": result.concurrency,
        "requests": len(result.records),
        "ok_requests": len(ok),
        "errors": sorted({r.error for r in result.records if not r.ok}),
        "max_tokens": result.max_tokens,
        "completion_tokens": tokens,
        "token_sources": sorted({r.token_source for r in ok}),
        "finish_reasons": {
            reason: sum(1 for r in ok if r.finish_reason == reason)
            for reason in sorted({str(r.finish_reason) for r in ok})
        },
        "wall_s": result.wall_s,
        "tokens_per_s": tokens / result.wall_s if result.wall_s > 0 else 0.0,
        "requests_per_s": len(ok) / result.wall_s if result.wall_s > 0 else 0.0,
        "latency_p50_s": _pct(lat, 50),
        "latency_p99_s": _pct(lat, 99),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_ms": _pct(tpot, 50),
        "tpot_mean_ms": float(np.mean(tpot)) if tpot else None,
        "itl_p50_ms": itl50,
        "itl_p99_ms": itl99,
        "itl_max_ms": max(gaps) if gaps else None,
        "itl_p99_over_p50": itl99 / itl50 if itl50 else None,
        "rss_warm_bytes": warm.rss_bytes,
        "rss_after_bytes": after.rss_bytes,
        "rss_peak_bytes": max(after.peak_bytes, warm.peak_bytes),
        "rss_after_over_warm": after.rss_bytes / warm.rss_bytes if warm.rss_bytes else None,
        "memory_source": after.source,
    }


def outputs_of(result: LoadResult) -> list[dict]:
    """Per-request text and token count, in load order, for the identity check and the JSON."""
    return [
        {
            "index": r.index,
            "prompt_id": r.prompt_id,
            "completion_tokens": r.completion_tokens,
            "finish_reason": r.finish_reason,
            "ttft_s": r.ttft_s,
            "latency_s": r.latency_s,
            "text": r.text if r.ok else None,
            "error": r.error,
        }
        for r in result.records
    ]


def identity(outputs: dict[int, list[dict]]) -> dict:
    """Greedy outputs (text and token count) at each concurrency vs the lowest one, per request."""
    if not outputs:
        return {"identical": None, "reference_concurrency": None, "differing": {}}
    ref_c = min(outputs)
    ref = outputs[ref_c]
    differing: dict[str, list[str]] = {}
    for c, outs in sorted(outputs.items()):
        if c == ref_c:
            continue
        differing[str(c)] = [
            a["prompt_id"]
            for a, b in zip(ref, outs, strict=True)
            if a["text"] is None
            or (a["text"], a["completion_tokens"]) != (b["text"], b["completion_tokens"])
        ]
    identical = len(outputs) > 1 and all(not d for d in differing.values())
    return {
        "identical": identical if len(outputs) > 1 else None,
        "reference_concurrency": ref_c,
        "differing": differing,
    }


def cross_match(ours: dict[int, list[dict]], theirs: dict[int, list[dict]]) -> dict[str, int]:
    """Requests whose text is the same from both servers, per concurrency (information only)."""
    return {
        str(c): sum(
            1
            for a, b in zip(ours[c], theirs[c], strict=True)
            if a["text"] is not None and a["text"] == b["text"]
        )
        for c in sorted(set(ours) & set(theirs))
    }


def median_run(rounds: list[tuple[dict, list[dict]]]) -> tuple[dict, list[dict]]:
    """The run with the median tokens/s (the lower of the two middle ones for an even count)
    of one server's rounds at one concurrency, and its outputs. The run records every round's
    tokens/s, which round it was, and whether every round gave the same greedy texts."""
    order = sorted(range(len(rounds)), key=lambda i: rounds[i][0]["tokens_per_s"])
    pick = order[(len(order) - 1) // 2]
    run, outputs = rounds[pick]
    texts = [[(o["text"], o["completion_tokens"]) for o in outs] for _, outs in rounds]
    run["round"] = pick + 1
    run["rounds_tokens_per_s"] = [r["tokens_per_s"] for r, _ in rounds]
    run["same_outputs_every_round"] = all(t == texts[0] for t in texts)
    return run, outputs


def round_ratios(ours: dict, theirs: dict) -> list[float] | None:
    """ours/theirs tokens/s round by round (the rounds ran side by side, so each ratio saw one
    state of the machine); None unless both ran the same rounds."""
    a, b = ours.get("rounds_tokens_per_s"), theirs.get("rounds_tokens_per_s")
    if not a or not b or len(a) != len(b) or not all(b):
        return None
    return [x / y for x, y in zip(a, b, strict=True)]


def ratio(ours: dict | None, theirs: dict | None, key: str) -> float | None:
    """ours[key] / theirs[key], None where either is missing. For tokens/s after several
    rounds: the median of the round-by-round ratios (paired, so a machine's drift between
    rounds cancels)."""
    if not ours or not theirs or not theirs.get(key) or ours.get(key) is None:
        return None
    paired = round_ratios(ours, theirs) if key == "tokens_per_s" else None
    if paired and len(paired) > 1:
        return float(np.median(paired))
    return ours[key] / theirs[key]
