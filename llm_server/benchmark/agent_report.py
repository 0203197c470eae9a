"""Markdown tables and the TTFT plot of `llm-benchmark --workload agent` (agent.py's report)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from llm_server.benchmark.plot import LABELS

MB = 1e6


def _cell(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _label(name: str, entry: dict) -> str:
    """The server's name; a second run of one kind keeps its suffix (vllm-mlx-2)."""
    kind = entry.get("kind", name)
    suffix = name[len(kind) :] if name.startswith(kind) else ""
    return LABELS.get(kind, kind) + suffix


def _ok(report: dict) -> list[tuple[str, dict]]:
    return [(n, e) for n, e in report["servers"].items() if e.get("conversations")]


def markdown(report: dict) -> str:
    meta = report["meta"]
    lines = [
        f"# Agent workload: {meta['model_name']}",
        "",
        f"{meta['conversations']} conversation(s) of {meta['turns']} turns built from "
        f"`{meta['agent_log']}` ({meta['source_path']}), replayed as streaming chat requests "
        f"one at a time, max_tokens {meta['max_tokens']}, temperature 0; prompt tokens by the "
        f"model's template: {', '.join('/'.join(map(str, s)) for s in meta['prompt_tokens_by_template'])}"
        f" (context {meta['context']}). Machine: {meta['machine']}; load average "
        f"{_loads(meta.get('load_average_start'))} at the start, "
        f"{_loads(meta.get('load_average_end'))} at the end. Commit {meta.get('git_commit')}.",
        "",
        "Cached tokens are what the server reports (OpenAI `usage.prompt_tokens_details."
        "cached_tokens`, llama-server `timings.cache_n`; `-`: the server does not say). "
        "Prefill tok/s = (prompt - cached) / TTFT; prompt tok/s = prompt / TTFT.",
        "",
    ]
    ok = _ok(report)
    if ok:
        lines += _side_by_side(ok)
    for name, entry in ok:
        lines += _server_table(name, entry)
    lines += [
        "## Per conversation",
        "",
        "| server | conversation | turns | total s | peak RSS MB |",
        "|---|---|---:|---:|---:|",
    ]
    for name, entry in ok:
        for conv in entry["conversations"]:
            lines.append(
                f"| {_label(name, entry)} | {conv['id']} | {len(conv['turns'])} "
                f"| {conv['total_s']:.1f} | {conv['peak_rss_bytes'] / MB:.0f} |"
            )
    lines.append("")
    if report["failures"]:
        lines += ["## Failures", ""]
        lines += [f"- {f['server']}: {f['error']}" for f in report["failures"]] + [""]
    lines += ["## Commands", ""]
    for name, entry in report["servers"].items():
        if entry.get("command"):
            lines.append(f"- {_label(name, entry)}: `{shlex.join(entry['command'])}`")
    return "\n".join(lines) + "\n"


def _loads(values) -> str:
    return "-" if not values else "/".join(f"{v:.1f}" for v in values)


def _side_by_side(ok: list[tuple[str, dict]]) -> list[str]:
    """TTFT of each turn (first conversation) per server."""
    names = [_label(n, e) for n, e in ok]
    turns = max(len(e["conversations"][0]["turns"]) for _, e in ok)
    lines = ["## TTFT per turn (s, first conversation)", "",
             "| turn | " + " | ".join(names) + " |", "|---:|" + "---:|" * len(names)]  # fmt: skip
    for t in range(turns):
        cells = []
        for _, e in ok:
            rows = e["conversations"][0]["turns"]
            cells.append(_cell(rows[t]["ttft_s"]) if t < len(rows) else "-")
        lines.append(f"| {t + 1} | " + " | ".join(cells) + " |")
    return lines + [""]


def _server_table(name: str, entry: dict) -> list[str]:
    lines = [
        f"## {_label(name, entry)}",
        "",
        "| conversation | turn | TTFT s | prompt tokens | cached tokens | new tokens "
        "| prefill tok/s | prompt tok/s | total s | error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for conv in entry["conversations"]:
        for r in conv["turns"]:
            lines.append(
                f"| {conv['id']} | {r['turn']} | {_cell(r['ttft_s'])} | {_cell(r['prompt_tokens'], 'd')} "
                f"| {_cell(r['cached_tokens'], 'd')} | {_cell(r['new_tokens'], 'd')} "
                f"| {_cell(r['prefill_tok_s'], '.0f')} | {_cell(r['prompt_tok_s'], '.0f')} "
                f"| {r['total_s']:.2f} | {r['error'] or ''} |"
            )
    return lines + [""]


def write_plot(report: dict, path: Path) -> None:
    """TTFT per turn, one line per server and conversation (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    for name, entry in _ok(report):
        for i, conv in enumerate(entry["conversations"]):
            turns = [r["turn"] for r in conv["turns"] if r["ttft_s"] is not None]
            ttft = [r["ttft_s"] for r in conv["turns"] if r["ttft_s"] is not None]
            label = _label(name, entry) + (f" ({conv['id']})" if i else "")
            ax.plot(turns, ttft, marker="o", label=label)
    meta = report["meta"]
    ax.set_xticks(range(1, meta["turns"] + 1))
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token (s)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title(f"{meta['model_name']}: agent conversation from {meta['agent_log']}")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """`python -m llm_server.benchmark.agent_report DIR`: rewrite DIR's benchmark.md and
    benchmark.png from its benchmark.json."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m llm_server.benchmark.agent_report RESULTS_DIR")
    out = Path(args[0])
    report = json.loads((out / "benchmark.json").read_text())
    (out / "benchmark.md").write_text(markdown(report))
    write_plot(report, out / "benchmark.png")


if __name__ == "__main__":
    main()
