"""Chat throughput by client concurrency on ONE scheduler, loads in sequence (issue 38, Deliver 5).

    python -m llm_server.native.blas .venv/bin/python -m llm_server.benchmark.spec_carryover \
        [--model PATH] [--loads 1,4,8] [--speculative ngram] [--requests 16] [--max-tokens 64]

The scheduler serves as the server does (the MLX engine with its default prefix cache, the
default `--concurrent-requests` rows, `--step-tokens`, `--speculative`) in this process, no
HTTP. For each load in `--loads` the client keeps c greedy chat requests in flight (the fixed
prompts of llm-benchmark, prompts.json, in order) until `--requests` are done, and prints one
JSON line: completion tok/s, the draft ids verified and kept in that load, and the spec
policy's state after it (the step-cost fit a, b, c in ms and each drafting source's rate).
Run `--loads 8` and `--loads 1,4,8` in fresh processes to see whether state carried over from
earlier loads changes the last one.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from llm_server.benchmark.speculative import chat_messages


def _load(sched, tok, messages: list[list[dict]], concurrency: int, max_tokens: int) -> dict:
    from llm_server.decoding import Decoder, SamplingParams
    from llm_server.scheduler import FinishEvent, GenerationRequest

    done: list[int] = []
    tokens = [0]
    drafted, accepted = sched.drafted_tokens, sched.accepted_tokens

    def submit(i: int) -> None:
        def emit(ev) -> None:
            if isinstance(ev, FinishEvent):
                done.append(i)
            else:
                tokens[0] += 1

        decoder = Decoder(SamplingParams(max_tokens, 0.0), tok.eos_token_ids, tok.decode)
        sched.submit(GenerationRequest(tok.apply_chat_template(messages[i]), decoder, emit))

    t0 = time.perf_counter()
    sent = min(concurrency, len(messages))
    for i in range(sent):
        submit(i)
    while len(done) < len(messages):
        if sent < len(messages) and sent - len(done) < concurrency:
            submit(sent)
            sent += 1
        else:
            time.sleep(0.002)
    seconds = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "tok_s": round(tokens[0] / seconds, 1),
        "drafted": sched.drafted_tokens - drafted,
        "accepted": sched.accepted_tokens - accepted,
        **sched.spec_costs.report(),
    }


def main(argv: list[str] | None = None) -> int:
    from llm_server.cli import DEFAULT_CONCURRENT
    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings
    from llm_server.scheduler import BatchScheduler
    from llm_server.tokenizer import Tokenizer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="default: the embedded SmolLM2-135M")
    p.add_argument("--loads", default="1,4,8", help="client concurrencies, in order")
    p.add_argument("--speculative", default="ngram", choices=["ngram", "off"])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rows", type=int, default=DEFAULT_CONCURRENT)
    args = p.parse_args(argv)
    if args.model is None:
        from llm_server.default_model import default_model_path

        args.model = default_model_path()
    tok = Tokenizer(args.model)
    sched = BatchScheduler(
        lambda: MLXEngine(args.model, EngineSettings(rows=args.rows)),
        max_concurrent=args.rows,
        max_queued=args.requests,
        speculative=args.speculative,
    ).start()
    sched.wait_ready(300)
    messages = chat_messages(args.requests)
    try:
        for c in (int(x) for x in args.loads.split(",")):
            r = _load(sched, tok, messages, c, args.max_tokens)
            print(json.dumps({"speculative": args.speculative, **r}), flush=True)
    finally:
        sched.close(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
