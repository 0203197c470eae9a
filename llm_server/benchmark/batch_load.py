"""The Batch API under load, on one server in one run: interactive tokens/s and TTFT at each
concurrency without and then with a batch running, and the batch's own throughput on an idle
server against the same lines sent as ordinary requests.

    python -m llm_server.native.blas python -m llm_server.benchmark.batch_load --lines 500
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from llm_server.benchmark import load
from llm_server.benchmark.runner import _tokenizer, load_prompts
from llm_server.benchmark.servers import ServerSpec, running

POLL_S = 0.2


@dataclass(frozen=True)
class BatchLoad:
    """What to measure: the batch, the interactive load beside it, the server."""

    model: Path
    lines: int = 500  # chat lines in the batch
    batch_max_tokens: int = 32  # max_tokens of each line
    concurrency: tuple[int, ...] = (1, 4)  # interactive streams
    requests: int = 8  # interactive requests per stream
    max_tokens: int = 64  # max_tokens of each interactive request
    rows: int = 8  # the server's --concurrent-requests
    max_queued: int = 64
    rounds: int = 1  # alone / with-batch pairs per concurrency
    logs: Path = Path("benchmark-results/batch_load")
    server_args: tuple[str, ...] = ()  # more llm-server flags (--batch-share)


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def batch_file(prompts: list[load.Prompt], lines: int, max_tokens: int) -> bytes:
    """`lines` greedy chat requests over `prompts` (cycling), one JSONL line each."""
    out = []
    for i in range(lines):
        body = {"messages": prompts[i % len(prompts)].messages, "max_tokens": max_tokens}
        line = {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions"}
        out.append(json.dumps({**line, "body": {**body, "temperature": 0.0}}))
    return ("\n".join(out) + "\n").encode()


def submit(http: httpx.Client, content: bytes) -> str:
    """Upload `content` and create a chat batch on it; returns the batch id."""
    file = http.post(
        "/v1/files", files={"file": ("lines.jsonl", content)}, data={"purpose": "batch"}
    )
    file.raise_for_status()
    batch = http.post(
        "/v1/batches",
        json={
            "input_file_id": file.json()["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    batch.raise_for_status()
    return batch.json()["id"]


def wait(http: httpx.Client, batch_id: str) -> dict:
    while True:
        batch = http.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            return batch
        time.sleep(POLL_S)


def output_tokens(http: httpx.Client, batch: dict) -> int:
    text = http.get(f"/v1/files/{batch['output_file_id']}/content").text
    lines = [json.loads(x) for x in text.splitlines() if x.strip()]
    return sum(x["response"]["body"]["usage"]["completion_tokens"] for x in lines)


def summarize(result: load.LoadResult) -> dict:
    """Tokens/s per request (its decode part) and in all, TTFT p50/p99 (seconds)."""
    ok = [r for r in result.records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    rates = [
        (r.completion_tokens - 1) / (r.latency_s - r.ttft_s)
        for r in ok
        if r.ttft_s is not None and r.completion_tokens > 1 and r.latency_s > r.ttft_s
    ]
    return {
        "concurrency": result.concurrency,
        "requests": len(result.records),
        "errors": len(result.records) - len(ok),
        "tokens_per_s": sum(r.completion_tokens for r in ok) / result.wall_s,
        "request_tokens_per_s_p50": _pct(rates, 50),
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
    }


def run(args: BatchLoad) -> dict:
    prompts = load_prompts()
    tok = _tokenizer(args.model)

    def count(text: str) -> int:
        return len(tok.encode(text).ids)

    content = batch_file(prompts, args.lines, args.batch_max_tokens)
    data = Path(tempfile.mkdtemp(prefix="batch-load-"))
    extra = ("--data-dir", str(data), *args.server_args)
    spec = ServerSpec("ours", args.model, args.rows, args.max_queued, extra_args=extra)
    report: dict = {
        "lines": args.lines,
        "rows": args.rows,
        "concurrency": list(args.concurrency),
        "server_args": list(args.server_args),
    }
    with (
        running(spec, args.logs / "server.log") as srv,
        httpx.Client(base_url=srv.url, timeout=900) as http,
    ):
        load.warm_up(srv.url, max(args.concurrency), args.max_tokens, count)

        def interactive(c: int) -> dict:
            n = args.requests * c
            return summarize(load.run_load(srv.url, prompts, c, n, args.max_tokens, count))

        # the batch alone on an idle server, then the same lines as ordinary requests
        t0 = time.perf_counter()
        batch = wait(http, submit(http, content))
        idle_s = time.perf_counter() - t0
        report["batch_idle"] = {
            "seconds": idle_s,
            "lines_per_s": args.lines / idle_s,
            "tokens_per_s": output_tokens(http, batch) / idle_s,
        }
        ordinary = load.run_load(srv.url, prompts, 8, args.lines, args.batch_max_tokens, count)
        report["ordinary_c8"] = {
            "seconds": ordinary.wall_s,
            "lines_per_s": args.lines / ordinary.wall_s,
            "tokens_per_s": sum(r.completion_tokens for r in ordinary.records) / ordinary.wall_s,
        }
        # interactive alone, then with a batch running (rounds alternate)
        report["interactive"] = {}
        for c in args.concurrency:
            rows = []
            for _ in range(args.rounds):
                alone = interactive(c)
                batch_id = submit(http, content)
                while http.get(f"/v1/batches/{batch_id}").json()["status"] == "validating":
                    time.sleep(0.05)
                time.sleep(1.0)  # the batch fills the rows
                before = http.get(f"/v1/batches/{batch_id}").json()
                during = interactive(c)
                after = http.get(f"/v1/batches/{batch_id}").json()
                http.post(f"/v1/batches/{batch_id}/cancel")
                wait(http, batch_id)
                still = after["status"] == "in_progress"
                lines = after["request_counts"]["completed"] - before["request_counts"]["completed"]
                rows.append({"alone": alone, "with_batch": during, "batch_lines_meanwhile": lines,
                             "batch_ran_throughout": still})  # fmt: skip
            report["interactive"][c] = rows
    return report


def _change(a: float | None, b: float | None) -> str:
    return "-" if not a or b is None else f"{(b - a) / a * 100:+.1f}%"


def markdown(report: dict) -> str:
    out = [
        f"Batch of {report['lines']} chat lines, {report['rows']} rows"
        f"{', ' + ' '.join(report['server_args']) if report['server_args'] else ''}.",
        "",
        "| concurrency | tokens/s alone | with batch | change | TTFT p50 alone | with batch "
        "| TTFT p99 alone | with batch | batch lines meanwhile |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c, rounds in report["interactive"].items():
        for r in rounds:
            a, w = r["alone"], r["with_batch"]
            out.append(
                f"| {c} | {a['request_tokens_per_s_p50']:.1f} | {w['request_tokens_per_s_p50']:.1f} "
                f"| {_change(a['request_tokens_per_s_p50'], w['request_tokens_per_s_p50'])} "
                f"| {a['ttft_p50_s'] * 1000:.0f} ms | {w['ttft_p50_s'] * 1000:.0f} ms "
                f"| {a['ttft_p99_s'] * 1000:.0f} ms | {w['ttft_p99_s'] * 1000:.0f} ms "
                f"| {r['batch_lines_meanwhile']} |"
            )
    idle, plain = report["batch_idle"], report["ordinary_c8"]
    out += [
        "",
        "| the lines | seconds | lines/s | tokens/s |",
        "|---|---|---|---|",
        f"| as a batch, idle server | {idle['seconds']:.1f} | {idle['lines_per_s']:.2f} "
        f"| {idle['tokens_per_s']:.1f} |",
        f"| as requests, concurrency 8 | {plain['seconds']:.1f} | {plain['lines_per_s']:.2f} "
        f"| {plain['tokens_per_s']:.1f} |",
    ]
    return "\n".join(out)


def measure(args: BatchLoad) -> str:
    """Run, write batch_load.json under `args.logs`, return the markdown tables."""
    report = run(args)
    args.logs.mkdir(parents=True, exist_ok=True)
    (args.logs / "batch_load.json").write_text(json.dumps(report, indent=2))
    return markdown(report)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="batch_load", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="default: the embedded SmolLM2")
    p.add_argument("--lines", type=int, default=500, help="chat lines in the batch")
    p.add_argument("--batch-max-tokens", type=int, default=32, help="max_tokens of each line")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--requests", type=int, default=8, help="interactive requests per stream")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens of interactive ones")
    p.add_argument("--rows", type=int, default=8, help="--concurrent-requests")
    p.add_argument("--max-queued", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--logs", type=Path, default=Path("benchmark-results/batch_load"))
    p.add_argument("--batch-share", action="store_true", help="the server's --batch-share")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.model is None:
        from llm_server.default_model import default_model_path

        args.model = default_model_path()
    settings = BatchLoad(
        model=args.model,
        lines=args.lines,
        batch_max_tokens=args.batch_max_tokens,
        concurrency=tuple(args.concurrency),
        requests=args.requests,
        max_tokens=args.max_tokens,
        rows=args.rows,
        max_queued=args.max_queued,
        rounds=args.rounds,
        logs=args.logs,
        server_args=("--batch-share",) if args.batch_share else (),
    )
    print(measure(settings))


if __name__ == "__main__":
    main()
