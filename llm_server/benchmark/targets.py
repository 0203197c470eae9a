"""The performance targets of issue 11, checked against one benchmark report.

Each target is met (True), not met (False), or cannot be judged from this run (None: the
comparison server or a concurrency was left out, or a section was unavailable).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from llm_server.benchmark.summary import ratio

THROUGHPUT_FLOOR = {1: 1.0, 4: 1.25, 8: 1.25}  # ours/mlx_lm tokens/s, by concurrency
PEER_FLOOR = {
    1: 1.0,
    4: 1.0,
    8: 1.0,
}  # ours/peer (llama-server) tokens/s, by concurrency (issue 22)
SCALING_MIN = 3.0  # our c4 tokens/s over our c1
RSS_RETURN_MAX = 1.15  # RSS after the load over RSS after warm-up
ROOFLINE_MIN = 0.40
SCORING_MIN = 3.0
ITL_TAIL_MAX = 1.5  # p99 inter-token gap over the median gap, at the highest concurrency
ENGINE_SHARE_MIN = 0.80  # served tokens/s over rows / (engine-only step time), same concurrency


@dataclass(frozen=True)
class Target:
    id: str
    description: str
    value: str  # what was measured, for the table
    met: bool | None


def _fmt(x: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if x is None else format(x, spec) + suffix


def _all(flags: list[bool | None]) -> bool | None:
    if not flags or any(f is None for f in flags):
        return None
    return all(flags)


def _ratio(report: dict, c: int, key: str, other: str = "mlx_lm") -> float | None:
    ours = report["servers"].get("ours", {}).get(str(c))
    theirs = report["servers"].get(other, {}).get(str(c))
    return ratio(ours, theirs, key)


def _throughput(report: dict) -> list[Target]:
    out = []
    for c, floor in THROUGHPUT_FLOOR.items():
        r = _ratio(report, c, "tokens_per_s")
        out.append(Target(f"throughput_c{c}", f"tokens/s >= {floor:.2f}x mlx_lm.server at concurrency {c}",
                          _fmt(r, suffix="x"), None if r is None else r >= floor))  # fmt: skip
    ours = report["servers"].get("ours", {})
    c1, c4 = ours.get("1"), ours.get("4")
    scale = c4["tokens_per_s"] / c1["tokens_per_s"] if c1 and c4 and c1["tokens_per_s"] else None
    out.append(Target("scaling_c4_c1", f"our concurrency-4 tokens/s >= {SCALING_MIN:.0f}x our concurrency 1",
                      _fmt(scale, suffix="x"), None if scale is None else scale >= SCALING_MIN))  # fmt: skip
    return out


def _peer(report: dict) -> list[Target]:
    """Ours against the peer server, when one ran (issue 22's llama-server comparison)."""
    peer = (report.get("meta") or {}).get("peer")
    if not peer:
        return []
    out = []
    for c, floor in PEER_FLOOR.items():
        r = _ratio(report, c, "tokens_per_s", peer["kind"])
        out.append(Target(f"peer_throughput_c{c}", f"tokens/s >= {floor:.2f}x {peer['label']} at concurrency {c}",
                          _fmt(r, suffix="x"), None if r is None else r >= floor))  # fmt: skip
    return out


def _no_worse(report: dict, key: str, label: str) -> Target:
    concurrencies = sorted(int(c) for c in report["servers"].get("ours", {}))
    ratios = {c: _ratio(report, c, key) for c in concurrencies}
    shown = ", ".join(f"c{c} {_fmt(r, suffix='x')}" for c, r in ratios.items())
    met = _all([None if r is None else r <= 1.0 for r in ratios.values()])
    return Target(
        key.replace("_s", ""),
        f"{label} no worse than mlx_lm.server at each concurrency",
        shown,
        met,
    )


def _memory(report: dict) -> list[Target]:
    ours = report["servers"].get("ours", {})
    peak = _no_worse(report, "rss_peak_bytes", "peak RSS")
    back = {c: s.get("rss_after_over_warm") for c, s in ours.items()}
    shown = ", ".join(
        f"c{c} {_fmt(r, suffix='x')}" for c, r in sorted(back.items(), key=lambda kv: int(kv[0]))
    )
    met = _all([None if r is None else r <= RSS_RETURN_MAX for r in back.values()])
    return [
        Target("rss_peak", peak.description, peak.value, peak.met),
        Target(
            "rss_return",
            f"RSS after the load within {RSS_RETURN_MAX - 1:.0%} of its post-warm-up level",
            shown,
            met,
        ),  # fmt: skip
    ]


def _steps(report: dict) -> list[Target]:
    """Issue 17: admissions do not stall the batch; serving keeps up with the engine."""
    ours = report["servers"].get("ours", {})
    c = max((int(k) for k in ours), default=None)
    top = ours.get(str(c))
    tail = top.get("itl_p99_over_p50") if top else None
    share = top.get("served_over_engine") if top else None
    return [
        Target("itl_tail", f"p99 inter-token gap <= {ITL_TAIL_MAX}x the median at concurrency {c}",
               _fmt(tail, suffix="x"), None if tail is None else tail <= ITL_TAIL_MAX),
        Target("engine_share", f"served tokens/s >= {ENGINE_SHARE_MIN:.0%} of the engine-only "
               f"rate at concurrency {c}", _fmt(share, ".0%"),
               None if share is None else share >= ENGINE_SHARE_MIN),
    ]  # fmt: skip


def evaluate(report: dict) -> list[dict]:
    """All targets as JSON-ready dicts, in the order the issue lists them."""
    targets = _throughput(report)
    targets.extend(_peer(report))
    targets.extend(_steps(report))
    targets.append(_no_worse(report, "latency_p99_s", "p99 latency"))
    targets.append(_no_worse(report, "ttft_p99_s", "p99 time to first token"))
    targets.extend(_memory(report))
    frac = (report.get("roofline") or {}).get("single_stream_fraction")
    targets.append(Target("roofline", f"single-stream decode >= {ROOFLINE_MIN:.0%} of the bandwidth roofline",
                          _fmt(frac, ".1%"), None if frac is None else frac >= ROOFLINE_MIN))  # fmt: skip
    speedup = (report.get("scoring") or {}).get("speedup")
    targets.append(Target("scoring", f"padded scoring >= {SCORING_MIN:.0f}x one prompt per request",
                          _fmt(speedup, suffix="x"), None if speedup is None else speedup >= SCORING_MIN))  # fmt: skip
    same = (report.get("identity") or {}).get("ours", {}).get("identical")
    targets.append(Target("greedy_identical", "greedy outputs identical across concurrencies (ours)",
                          {True: "identical", False: "differ", None: "n/a"}[same], same))  # fmt: skip
    return [asdict(t) for t in targets]
