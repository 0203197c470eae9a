"""Prefix-cache benchmark: time to first token on a multi-turn workload, cache on vs off.

Chats share a long system prompt and resend their whole history every turn, as local chat apps
do. The same workload runs against two fresh servers, one with the prefix cache (default bound)
and one with `--prefix-cache-bytes 0`; greedy outputs must be identical.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx

from llm_server.benchmark.servers import ServerSpec, running

SYSTEM = (
    "You are a concise assistant inside a note-taking app. Answer in one or two sentences, "
    "use plain words, never invent facts, and say so when you do not know. "
) * 6
QUESTIONS = [
    "What is a good way to start a daily journal?",
    "How do I keep a shopping list short?",
    "Give me one tip for remembering names.",
    "What should a packing list for a weekend trip include?",
]
FOLLOW_UPS = ["Can you say more?", "Give an example.", "Summarize that in five words."]


async def _turn(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first, text, usage = None, "", None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter() - t0
                    text += piece
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"ttft_s": first if first is not None else time.perf_counter() - t0, "text": text,
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "cached_tokens": cached}  # fmt: skip


async def _chat(client: httpx.AsyncClient, url: str, question: str, turns: int, max_tokens: int):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    out = []
    for t in range(turns):
        r = await _turn(client, url, messages, max_tokens)
        out.append(r)
        messages += [{"role": "assistant", "content": r["text"]},
                     {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]  # fmt: skip
    return out


async def _workload(url: str, chats: int, turns: int, max_tokens: int) -> list[list[dict]]:
    async with httpx.AsyncClient(timeout=600) as client:
        await _turn(client, url, [{"role": "user", "content": "Hi"}], 4)  # warm-up
        return await asyncio.gather(
            *[
                _chat(client, url, QUESTIONS[i % len(QUESTIONS)], turns, max_tokens)
                for i in range(chats)
            ]
        )


def run(model: Path, out: Path, chats: int = 4, turns: int = 4, max_tokens: int = 24) -> dict:
    results = {}
    for label, extra in (("on", ()), ("off", ("--prefix-cache-bytes", "0"))):
        spec = ServerSpec("ours", model, concurrency=chats, max_queued=chats, extra_args=extra)
        with running(spec, out / "logs" / f"prefix-{label}.log") as srv:
            results[label] = asyncio.run(_workload(srv.url, chats, turns, max_tokens))
    rows = []
    for t in range(turns):
        on = [c[t] for c in results["on"]]
        off = [c[t] for c in results["off"]]
        rows.append({
            "turn": t + 1,
            "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] or 0 for r in on),
            "cached_tokens_mean": statistics.mean(r["cached_tokens"] for r in on),
            "ttft_on_s": statistics.mean(r["ttft_s"] for r in on),
            "ttft_off_s": statistics.mean(r["ttft_s"] for r in off),
        })  # fmt: skip
    identical = all(
        a["text"] == b["text"] for ca, cb in zip(results["on"], results["off"], strict=True)
        for a, b in zip(ca, cb, strict=True)
    )  # fmt: skip
    report = {"chats": chats, "turns": turns, "max_tokens": max_tokens, "turns_table": rows,
              "outputs_identical": identical}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefix.json").write_text(json.dumps(report, indent=2))
    (out / "prefix.md").write_text(markdown(report))
    return report


def markdown(report: dict) -> str:
    lines = [
        f"## Prefix cache: {report['chats']} concurrent chats x {report['turns']} turns, "
        f"{report['max_tokens']} new tokens per turn",
        "",
        "| turn | prompt tokens | cached tokens | TTFT cache on (s) | TTFT cache off (s) | off/on |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["turns_table"]:
        ratio = r["ttft_off_s"] / r["ttft_on_s"] if r["ttft_on_s"] else float("nan")
        lines.append(
            f"| {r['turn']} | {r['prompt_tokens_mean']:.0f} | {r['cached_tokens_mean']:.0f} | "
            f"{r['ttft_on_s']:.3f} | {r['ttft_off_s']:.3f} | {ratio:.2f}x |"
        )
    lines += [
        "",
        f"Greedy outputs identical with the cache on and off: {report['outputs_identical']}",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from llm_server.native.blas import ensure_fast_blas

    ensure_fast_blas()
    p = argparse.ArgumentParser(prog="python -m llm_server.benchmark.prefix", description=__doc__)
    p.add_argument("--model", type=Path, help="model folder (default: the embedded SmolLM2)")
    p.add_argument("--out", type=Path, default=Path("benchmark-results/prefix"))
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=24)
    args = p.parse_args(argv)
    if args.model is None:
        from llm_server.default_model import default_model_path

        args.model = default_model_path()
    report = run(args.model, args.out, args.chats, args.turns, args.max_tokens)
    print(markdown(report))
    return 0 if report["outputs_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
