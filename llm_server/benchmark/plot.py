"""PNG plot: throughput and p99 latency against concurrency, ours vs mlx_lm.server."""

from __future__ import annotations

from pathlib import Path

LABELS = {"ours": "llm-server", "mlx_lm": "mlx_lm.server", "llama_server": "llama-server",
          "vllm_mlx": "vllm-mlx", "rapid_mlx": "rapid-mlx", "ours_page": "llm-server, page open",
          "llm_server_peer": "llm-server (peer build)"}  # fmt: skip


def write_plot(report: dict, path: Path) -> None:
    """Two panels side by side; matplotlib with the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_lat) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    ticks = sorted({int(c) for runs in report["servers"].values() for c in runs})
    for name, runs in report["servers"].items():
        cs = sorted(int(c) for c in runs)
        if not cs:
            continue
        tps = [runs[str(c)]["tokens_per_s"] for c in cs]
        p99 = [runs[str(c)]["latency_p99_s"] or 0.0 for c in cs]
        ax_tps.plot(cs, tps, marker="o", label=LABELS.get(name, name))
        ax_lat.plot(cs, p99, marker="o", label=LABELS.get(name, name))
    for ax, title, unit in ((ax_tps, "Aggregate throughput", "completion tokens/s"),
                            (ax_lat, "p99 request latency", "seconds")):  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(c) for c in ticks])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    meta = report["meta"]
    fig.suptitle(f"{meta['model_name']}: {meta['requests']} requests x {meta['max_tokens']} tokens")
    fig.savefig(path, dpi=120)
    plt.close(fig)
