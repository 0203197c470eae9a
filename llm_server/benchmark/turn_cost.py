"""A conversation turn's cost, ours beside llama-server on the same token ids: the new tokens of
a turn over a long cached prefix, against the same number of new tokens alone.

    python -m llm_server.native.blas python -m llm_server.benchmark.turn_cost \
        [--model PATH] [--cached 3700] [--new 20] [--turns 4] \
        [--llama-server BIN --gguf FILE [--llama-threads 2]]

Each server (two rows / slots: the conversation's and one for the rest) gets a history of
`--cached` random token ids once (cold), then per turn the history grows by `--new` random ids
and is sent again (`max_tokens`/`n_predict` 1; ours through /v1/completions with the prefix
cache, llama-server through /completion with `cache_prompt`), then `--new` unrelated random ids
alone (nothing cached shares them; llama-server with `cache_prompt` false). Times are the wall
time of each non-streamed request, the same for both servers. Reported per server and turn: turn
s, alone s and their ratio: what reusing the cached prefix costs beyond computing the new tokens,
including their attention over it.

That attention is work the new tokens alone do not have, whatever the cache: `floor` is the
turn's arithmetic over the alone request's (`arithmetic_floor`: weight products, attention
scores and sums, the head), the ratio a server would show if it ran both at one rate and reused
the prefix for free. `over floor` (ratio / floor) is then what reusing costs beyond that: the
prefix lookup and copy, attention running at another rate than the products, the HTTP round.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from llm_server.benchmark.servers import (
    ServerSpec,
    add_llama_server_args,
    llama_server_cmd,
    running,
)


def _sender(client: httpx.Client, ours: bool):
    """`send(ids, cache) -> (seconds, cached tokens)` over one server's completion route: ours'
    /v1/completions (the prefix cache always on), llama-server's /completion (`cache_prompt`)."""

    def send(ids: list[int], cache: bool) -> tuple[float, int]:
        if ours:
            path, body = "/v1/completions", {"prompt": ids, "max_tokens": 1}
        else:
            path, body = "/completion", {"prompt": ids, "n_predict": 1, "cache_prompt": cache}
        t0 = time.perf_counter()
        r = client.post(path, json={**body, "temperature": 0})
        seconds = time.perf_counter() - t0
        r.raise_for_status()
        if ours:
            return seconds, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return seconds, r.json()["timings"]["cache_n"]

    return send


def arithmetic_floor(config: dict, cached: int, new: int) -> float:
    """Multiply-adds of `new` tokens after `cached` positions over those of `new` tokens alone,
    for a llama-shaped decoder (`config`: its config.json): per token the weight products
    (q, k, v, o, gate, up, down), per token and earlier position the attention scores and
    weighted sum of every head, and the head's product for the last token (one is generated)."""
    d, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    dh = config.get("head_dim") or d // heads
    products = layers * (2 * d * heads * dh + 2 * d * kv * dh + 3 * d * config["intermediate_size"])
    head = d * config["vocab_size"]
    attend = 2 * layers * heads * dh  # per (query, key) pair: q.k and p*v

    def work(start: int) -> int:
        pairs = sum(start + i + 1 for i in range(new))
        return new * products + pairs * attend + head

    return work(cached) / work(0)


def countable(config: dict) -> dict | None:
    """`config` when `arithmetic_floor` can count it (a llama-shaped config.json), else None:
    the tables then leave the floor out rather than report a wrong one."""
    try:
        arithmetic_floor(config, 1, 1)
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return config


def turns(send, cached: int, new: int, count: int, vocab: int) -> list[dict]:
    """`send(ids, cache) -> (seconds, cached tokens)` on one server: the cold history, then
    `count` turns, each followed by its new tokens alone. The same ids for every server."""
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(vocab // 8, vocab) for _ in range(n)]  # noqa: E731
    send(ids(64), False)  # the first forwards' warm-up
    history = ids(cached)
    cold_s, hit = send(history, True)
    rows = [{"turn": 1, "prompt": len(history), "cached": hit, "turn_s": round(cold_s, 3)}]
    for t in range(count):
        history = history + ids(new)
        turn_s, hit = send(history, True)
        alone_s, _ = send(ids(new), False)
        rows.append({"turn": t + 2, "prompt": len(history), "cached": hit,
                     "turn_s": round(turn_s, 3), "alone_s": round(alone_s, 3),
                     "ratio": round(turn_s / alone_s, 2)})  # fmt: skip
        send(history, True)  # the llama-server slot's cache back on the conversation
    return rows


def markdown(
    results: dict[str, list[dict]], cached: int, new: int, config: dict | None = None
) -> str:
    """The servers side by side per turn, their medians, and with the model's `config` each
    turn's arithmetic floor and every server's median ratio over it."""
    names = list(results)
    floors = {}
    if config is not None:
        floors = {r["turn"]: arithmetic_floor(config, r["prompt"] - new, new)
                  for r in results[names[0]] if "ratio" in r}  # fmt: skip
    lines = [
        f"## A turn of {new} new tokens over {cached}+ cached, against {new} tokens alone",
        "",
        "| turn | prompt | "
        + " | ".join(f"{n} cached | {n} turn s | {n} alone s | {n} ratio" for n in names)
        + (" | floor |" if floors else " |"),
        "|---:|---:|" + "---:|" * (4 * len(names) + bool(floors)),
    ]
    for i, first in enumerate(results[names[0]]):
        if "ratio" not in first:
            continue
        cells = []
        for n in names:
            r = results[n][i]
            cells += [str(r["cached"]), f"{r['turn_s']:.3f}", f"{r['alone_s']:.3f}",
                      f"{r['ratio']:.2f}"]  # fmt: skip
        if floors:
            cells.append(f"{floors[first['turn']]:.2f}")
        lines.append(f"| {first['turn']} | {first['prompt']} | " + " | ".join(cells) + " |")
    lines.append("")
    for n in names:
        later = [r for r in results[n] if "ratio" in r]
        line = (f"{n}: median turn {statistics.median(r['turn_s'] for r in later):.3f} s, "
                f"median ratio {statistics.median(r['ratio'] for r in later):.2f}")  # fmt: skip
        if floors:
            over = statistics.median(r["ratio"] / floors[r["turn"]] for r in later)
            line += f", over floor {over:.2f}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from llm_server.native.blas import ensure_fast_blas

    ensure_fast_blas()
    p = argparse.ArgumentParser(
        prog="python -m llm_server.benchmark.turn_cost", description=__doc__
    )
    p.add_argument("--model", type=Path, help="model folder (default: the embedded SmolLM2)")
    p.add_argument("--cached", type=int, default=3700)
    p.add_argument("--new", type=int, default=20)
    p.add_argument("--turns", type=int, default=4)
    add_llama_server_args(p)
    p.add_argument("--out", type=Path, default=Path("benchmark-results/turn_cost"))
    args = p.parse_args(argv)
    cmd = llama_server_cmd(p, args, ctx=args.cached + args.new * (args.turns + 1) + 256, slots=2)
    if args.model is None:
        from llm_server.default_model import default_model_path

        args.model = default_model_path()
    config = json.loads((args.model / "config.json").read_text())
    vocab = min(config["vocab_size"], 30000)
    results = {}
    logs = args.out / "logs"
    spec = ServerSpec("ours", args.model, concurrency=2, max_queued=4)
    with running(spec, logs / "ours.log") as srv, httpx.Client(base_url=srv.url, timeout=900) as c:
        results["ours"] = turns(_sender(c, True), args.cached, args.new, args.turns, vocab)
    if cmd:
        spec = ServerSpec("llama_server", Path("-"), concurrency=2, max_queued=1, peer_cmd=cmd)
        with (
            running(spec, logs / "llama-server.log") as srv,
            httpx.Client(base_url=srv.url, timeout=900) as c,
        ):
            results["llama-server"] = turns(
                _sender(c, False), args.cached, args.new, args.turns, vocab
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "turn_cost.json").write_text(json.dumps(results, indent=2))
    text = markdown(results, args.cached, args.new, countable(config))
    (args.out / "turn_cost.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
