"""Write the benchmark's JSON file and Markdown tables."""

from __future__ import annotations

import json
from pathlib import Path

from llm_server.benchmark.summary import ratio, round_ratios

MB = 1e6
SERVERS = ("ours", "mlx_lm")
MET = {True: "met", False: "**not met**", None: "n/a"}


def write_json(report: dict, path: Path) -> None:
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n")


def _num(x: float | None, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def _one(s: dict | None, key: str, scale: float = 1.0, spec: str = ".2f") -> str:
    return _num(None if not s or s.get(key) is None else s[key] * scale, spec)


def _pair(
    ours: dict | None, theirs: dict | None, key: str, scale: float = 1.0, spec: str = ".2f"
) -> str:
    return f"{_one(ours, key, scale, spec)} / {_one(theirs, key, scale, spec)}"


def _ratio(ours: dict | None, theirs: dict | None, key: str) -> str:
    r = ratio(ours, theirs, key)
    return "–" if r is None else f"{r:.2f}x"


def _rounds_note(meta: dict) -> str:
    n = meta.get("rounds") or 1
    return "" if n < 2 else f", {n} rounds with the servers' order alternating"


def _each_round(run: dict | None) -> str:
    values = (run or {}).get("rounds_tokens_per_s") or []
    return ", ".join(f"{v:.1f}" for v in values) or "–"


def rounds_table(report: dict, other: str) -> list[str]:
    """Every round's tokens/s of ours and `other` and their ratio, when there were rounds."""
    if not _rounds_note(report["meta"]):
        return []
    lines = [
        "Round by round (servers alternating; the tables show each server's median run, the "
        "ratio is the median of the rounds' ratios):",
        "",
        f"| concurrency | tok/s ours by round | tok/s {other} by round | ours/{other} by round | median ratio |",
        "|---:|---|---|---|---:|",
    ]
    for c, o, t in _rows(report, other):
        ratios = round_ratios(o, t) if o and t else None
        lines.append(
            f"| {c} | {_each_round(o)} | {_each_round(t)} "
            f"| {', '.join(f'{r:.2f}' for r in ratios) if ratios else '–'} "
            f"| {_ratio(o, t, 'tokens_per_s')} |"
        )
    changed = [
        f"{name} at concurrency {c}"
        for name in ("ours", other)
        for c, run in sorted(report["servers"].get(name, {}).items(), key=lambda kv: int(kv[0]))
        if run.get("same_outputs_every_round") is False
    ]
    if changed:
        lines += ["", f"Greedy outputs changed between rounds: {', '.join(changed)}."]
    return lines + [""]


def _rows(report: dict, other: str = "mlx_lm") -> list[tuple[int, dict | None, dict | None]]:
    servers = report["servers"]
    cs = sorted({int(c) for s in ("ours", other) for c in servers.get(s, {})})
    return [
        (c, servers.get("ours", {}).get(str(c)), servers.get(other, {}).get(str(c))) for c in cs
    ]


def throughput_table(report: dict, other: str = "mlx_lm") -> list[str]:
    """Ours against `other` (a server kind of the report) at each concurrency."""
    lines = [
        f"| concurrency | tok/s ours | tok/s {other} | ours/{other} | req/s ours / {other} | p50 latency s | p99 latency s | p50 TTFT s | p99 TTFT s | TPOT p50 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c, o, t in _rows(report, other):
        lines.append(
            f"| {c} | {_one(o, 'tokens_per_s', spec='.1f')} | {_one(t, 'tokens_per_s', spec='.1f')} "
            f"| {_ratio(o, t, 'tokens_per_s')} | {_pair(o, t, 'requests_per_s', spec='.2f')} "
            f"| {_pair(o, t, 'latency_p50_s')} | {_pair(o, t, 'latency_p99_s')} "
            f"| {_pair(o, t, 'ttft_p50_s', spec='.3f')} | {_pair(o, t, 'ttft_p99_s', spec='.3f')} "
            f"| {_pair(o, t, 'tpot_p50_ms', spec='.1f')} |"
        )
    return lines


def _step_tokens(meta: dict) -> str:
    value = meta.get("step_tokens")
    return "(its default)" if value is None else str(value)


def steps_table(report: dict) -> list[str]:
    """Inter-token gaps and the engine-only rate (issue 17): does serving keep up?"""
    lines = [
        "| concurrency | ITL p50 ms | ITL p99 ms | p99/p50 | ITL max ms | engine step ms | engine tok/s | served tok/s | served/engine |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c, o, _ in _rows(report):
        lines.append(
            f"| {c} | {_one(o, 'itl_p50_ms', spec='.1f')} | {_one(o, 'itl_p99_ms', spec='.1f')} "
            f"| {_one(o, 'itl_p99_over_p50', spec='.2f')} | {_one(o, 'itl_max_ms', spec='.0f')} "
            f"| {_one(o, 'engine_step_ms', spec='.1f')} | {_one(o, 'engine_tokens_per_s', spec='.1f')} "
            f"| {_one(o, 'tokens_per_s', spec='.1f')} | {_one(o, 'served_over_engine', 100, '.0f')}% |"
        )
    return lines


def memory_table(report: dict, other: str = "mlx_lm") -> list[str]:
    lines = [
        "| concurrency | peak RSS MB | RSS after warm-up MB | RSS after load MB | after/warm-up |",
        "|---:|---:|---:|---:|---:|",
    ]
    for c, o, t in _rows(report, other):
        lines.append(
            f"| {c} | {_pair(o, t, 'rss_peak_bytes', 1 / MB, '.0f')} "
            f"| {_pair(o, t, 'rss_warm_bytes', 1 / MB, '.0f')} "
            f"| {_pair(o, t, 'rss_after_bytes', 1 / MB, '.0f')} "
            f"| {_pair(o, t, 'rss_after_over_warm', spec='.2f')} |"
        )
    return lines


def _peer_lines(report: dict) -> list[str]:
    peer = report["meta"].get("peer")
    if not peer:
        return []
    kind, label = peer["kind"], peer["label"]
    return [
        f"## Throughput and latency against {label} (cells: ours / {label})",
        "",
        f"{label} ran as `{peer['command']}` ({{port}} and {{concurrency}} filled in per run).",
        "",
        *throughput_table(report, kind),
        "",
        *rounds_table(report, kind),
        f"Memory (cells: ours / {label}):",
        "",
        *memory_table(report, kind),
        "",
    ]


def _page_lines(report: dict) -> list[str]:
    """--page-poll: the same server with a client polling as the open page does (issue 46)."""
    runs = report["servers"].get("ours_page")
    if not runs:
        return []
    polls = ", ".join(
        f"{run.get('page_polls', 0)} at concurrency {c}"
        for c, run in sorted(runs.items(), key=lambda kv: int(kv[0]))
    )
    return [
        "## The page open (cells: page closed / page polling)",
        "",
        "`ours_page` is our server again, with a client fetching the page's files and then "
        f"GET /ui/api/state once a second during the load (polls: {polls}).",
        "",
        *throughput_table(report, "ours_page"),
        "",
        *rounds_table(report, "ours_page"),
    ]


def _identity_lines(report: dict) -> list[str]:
    lines = []
    peer = report["meta"].get("peer")
    for name in SERVERS + ((peer["kind"],) if peer else ()):
        ident = report.get("identity", {}).get(name)
        if not ident or ident.get("identical") is None:
            continue
        if ident["identical"]:
            verdict = "identical"
        else:
            verdict = "differ: " + "; ".join(
                f"c{c}: {', '.join(ids)}" for c, ids in ident["differing"].items() if ids
            )
        lines.append(
            f"- {name}: greedy outputs at every concurrency vs c{ident['reference_concurrency']}: {verdict}"
        )
    cross = report.get("identity", {}).get("ours_vs_mlx_lm_same_text")
    if cross:
        n = report["meta"]["requests"]
        shown = ", ".join(f"c{c} {k}/{n}" for c, k in cross.items())
        lines.append(f"- ours vs mlx_lm.server, same text (information only): {shown}")
    return lines


def _scoring_lines(scoring: dict | None) -> list[str]:
    if not scoring:
        return ["Not run."]
    if scoring.get("status") != "ok":
        return [f"Unavailable: {scoring.get('error')}"]
    lengths = scoring["lengths"]
    return [
        f"{scoring['prompts']} prompts of {min(lengths)}-{max(lengths)} tokens ({sum(lengths)} tokens), "
        f"`/v1/completions` echo+logprobs, max_tokens 0, on our server at concurrency "
        f"{scoring['server_concurrency']}; best of {scoring['repeats']}.",
        "",
        "| mode | requests | wall s | tokens scored/s |",
        "|---|---:|---:|---:|",
        f"| padded batches (one request) | 1 | {scoring['padded_wall_s']:.2f} | {scoring['padded_tokens_per_s']:.0f} |",
        f"| one prompt per request | {scoring['prompts']} | {scoring['sequential_wall_s']:.2f} "
        f"| {scoring['sequential_tokens_per_s']:.0f} |",
        "",
        f"Speed-up {scoring['speedup']:.2f}x; largest |logprob| difference padded vs alone: "
        f"{scoring['max_abs_logprob_diff']:.2e}.",
    ]


def _roofline_lines(roof: dict | None) -> list[str]:
    if not roof:
        return ["Not run."]
    return [
        f"Read bandwidth {roof['bandwidth_gb_s']:.1f} GB/s (sum of a {roof['array_bytes'] / 2**20:.0f} MiB "
        f"float32 array, {roof['threads']} thread(s), best of {roof['repeats']} before and after the run); weights read per decode "
        f"step {roof['weight_bytes'] / MB:.1f} MB; roofline {roof['roofline_tokens_per_s']:.1f} tok/s; "
        f"our single-stream decode {_num(roof.get('single_stream_tokens_per_s'), '.1f')} tok/s = "
        f"{_num(roof.get('single_stream_fraction'), '.1%')} of the roofline "
        f"(mlx_lm.server {_num(roof.get('mlx_lm_single_stream_fraction'), '.1%')}).",
    ]


def _load(meta: dict) -> str:
    start, end = meta.get("load_average_start"), meta.get("load_average_end")
    if not start or not end:
        return "unknown"
    return f"{start[0]:.1f} at the start, {end[0]:.1f} at the end (1-minute)"


def _prefix_lines(section: dict | None) -> list[str]:
    if not section:
        return []
    from llm_server.benchmark.prefix import markdown as prefix_markdown

    return [prefix_markdown(section)]


def _constrained_lines(section: dict | None) -> list[str]:
    if not section:
        return []
    head = ["## Constrained decoding", ""]
    if section.get("status") != "ok":
        return [*head, f"Unavailable: {section.get('error') or section.get('exit_code')}", ""]
    md = Path(section["markdown"]) if section.get("markdown") else None
    body = md.read_text().strip() if md and md.is_file() else "Ran; no Markdown was written."
    return [*head, body, ""]


def markdown(report: dict) -> str:
    meta = report["meta"]
    ours = report["servers"].get("ours", {})
    c1, c4 = ours.get("1"), ours.get("4")
    scaling = (
        _num(c4["tokens_per_s"] / c1["tokens_per_s"]) + "x"
        if c1 and c4 and c1["tokens_per_s"]
        else "–"
    )
    lines = [
        f"# llm-benchmark: {meta['model_name']}",
        "",
        f"{meta['started']} · {meta['machine']} · BLAS preload: {meta['blas_preload'] or 'none'} · "
        f"{'quick' if meta['quick'] else 'full'} run · load average {_load(meta)} · "
        f"commit {meta.get('git_commit') or 'unknown'}",
        "",
        f"Load per concurrency: {meta['requests']} streaming chat requests from {meta['prompt_count']} "
        f"fixed prompts, max_tokens {meta['max_tokens']}, temperature 0; each server started fresh "
        f"per concurrency and warmed up with that many requests{_rounds_note(meta)}. {meta['mlx_lm_note']}",
        f"Completion tokens: {meta['token_counting']}",
        "",
        "## Throughput and latency (cells: ours / mlx_lm.server)",
        "",
        *throughput_table(report),
        "",
        *rounds_table(report, "mlx_lm"),
        f"Our concurrency-4 / concurrency-1 throughput: {scaling}",
        "",
        "## Steps: inter-token gaps and the engine-only rate (ours)",
        "",
        "Gaps between consecutive streamed deltas of one request; the engine rate is N rows / "
        "the median N-row decode step of the engine alone (llm_server.benchmark.engine_rate). "
        f"Our server ran with --step-tokens {_step_tokens(meta)}.",
        "",
        *steps_table(report),
        "",
        "## Memory (cells: ours / mlx_lm.server)",
        "",
        *memory_table(report),
        "",
        *_peer_lines(report),
        *_page_lines(report),
        "## Greedy output identity",
        "",
        *(_identity_lines(report) or ["Only one concurrency was run."]),
        "",
        "## Scoring",
        "",
        *_scoring_lines(report.get("scoring")),
        "",
        "## Roofline",
        "",
        *_roofline_lines(report.get("roofline")),
        "",
        "## Targets (issue 11)",
        "",
        "| target | measured | result |",
        "|---|---|---|",
        *(f"| {t['description']} | {t['value']} | {MET[t['met']]} |" for t in report["targets"]),
        "",
        *_constrained_lines(report.get("constrained")),
        *_prefix_lines(report.get("prefix_cache")),
    ]
    return "\n".join(lines)


def write_markdown(report: dict, path: Path) -> None:
    path.write_text(markdown(report))
