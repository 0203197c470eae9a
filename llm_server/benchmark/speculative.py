"""Speculative decoding benchmark: an "edit" workload vs the chat workload, drafts on vs off.

    python -m llm_server.native.blas python -m llm_server.benchmark.speculative [--model DIR]

The edit workload asks the model to reproduce a given passage (code or text) with one change,
the case prompt-lookup drafts are for; the chat workload is the first prompts of
llm-benchmark's fixed set (prompts.json). Both run greedy on the scheduler in-process (no
HTTP), at each concurrency, `--speculative off` and `ngram` alternating (`--repeats` each, the
median time), on the same engine settings; it prints completion tok/s, the draft acceptance
rate and whether the outputs were identical.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

EDIT_PASSAGES = [
    (
        "Rename the variable `total` to `acc` and reproduce the rest of the code exactly",
        "def summarize(values):\n    total = 0\n    count = 0\n    for value in values:\n"
        "        if value is None:\n            continue\n        total += value\n"
        "        count += 1\n    if count == 0:\n        return 0.0\n    return total / count\n",
    ),
    (
        "Change the city from Paris to Lyon and reproduce the rest of the text exactly",
        "Our team will meet in Paris on Monday morning. The meeting starts at nine and ends "
        "at noon. After the meeting, everyone is invited to lunch near the station in Paris. "
        "Please bring your laptop, your notes from last week, and any questions you have.",
    ),
    (
        "Add a docstring to the function and reproduce the rest of the code exactly",
        "def clamp(x, low, high):\n    if x < low:\n        return low\n    if x > high:\n"
        "        return high\n    return x\n\n\ndef scale(xs, factor):\n"
        "    return [clamp(x * factor, 0, 255) for x in xs]\n",
    ),
    (
        "Fix the typo 'recieve' and reproduce the rest of the text exactly",
        "Customers will recieve an email within two days of placing an order. The email "
        "contains the tracking number and the expected delivery date. If you do not recieve "
        "it, check your spam folder or contact support with your order number.",
    ),
]


def edit_messages() -> list[list[dict]]:
    return [
        [{"role": "user", "content": f"{task}:\n\n{passage}"}] for task, passage in EDIT_PASSAGES
    ]


def chat_messages(n: int) -> list[list[dict]]:
    data = json.loads((Path(__file__).with_name("prompts.json")).read_text())
    return [p["messages"] for p in data["prompts"][:n]]


def run(model: Path, prompts, rows: int, mode: str, max_tokens: int, k: int):
    """(tokens per prompt, seconds, drafted, accepted, fit_report) serving `prompts` together."""
    from llm_server.decoding import Decoder, SamplingParams
    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings
    from llm_server.scheduler import BatchScheduler, FinishEvent, GenerationRequest
    from llm_server.tokenizer import Tokenizer

    tok = Tokenizer(model)
    sched = BatchScheduler(
        lambda: MLXEngine(model, EngineSettings(rows=rows, prefix_cache_bytes=0)),
        max_concurrent=rows,
        max_queued=len(prompts),
        speculative=mode,
        spec_tokens=k,
    ).start()
    sched.wait_ready(300)
    outs: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)

    def emitter(i):
        def emit(ev):
            if isinstance(ev, FinishEvent):
                done[i] = True
            else:
                outs[i].append(ev.token_id)

        return emit

    reqs = [
        GenerationRequest(
            tok.apply_chat_template(m),
            Decoder(SamplingParams(max_tokens, 0.0), tok.eos_token_ids, tok.decode),
            emitter(i),
        )
        for i, m in enumerate(prompts)
    ]
    t0 = time.perf_counter()
    sched.submit_all(reqs)
    while not all(done):
        time.sleep(0.005)
    seconds = time.perf_counter() - t0
    sched.close(30)
    return outs, seconds, sched.drafted_tokens, sched.accepted_tokens, fit_report(sched)


def fit_report(sched) -> dict:
    """The spec policy's state after a run: the step-cost fit (a, b, c in ms), each drafting
    source's rate, the decode steps and the draft ids verified and kept."""
    return {
        **sched.spec_costs.report(),
        "decode_steps": sched.decode_steps,
        "drafted": sched.drafted_tokens,
        "accepted": sched.accepted_tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="default: the embedded SmolLM2-135M")
    p.add_argument("--concurrency", default="1,4", help="comma-separated row counts")
    p.add_argument("--chat-prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--spec-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2, help="runs of each mode (median time)")
    p.add_argument("--workloads", default="edit,chat", help="comma-separated: edit, chat")
    p.add_argument("--fit", action="store_true", help="print the cost model's fit per ngram run")
    args = p.parse_args(argv)
    if args.model is None:
        from llm_server.default_model import default_model_path

        args.model = default_model_path()
    loads = {"edit": edit_messages(), "chat": chat_messages(args.chat_prompts)}
    print("| workload | c | off tok/s | ngram tok/s | speedup | accepted/drafted | same output |")
    print("|---|---|---|---|---|---|---|")
    for name, prompts in loads.items():
        if name not in args.workloads.split(","):
            continue
        for rows in (int(c) for c in args.concurrency.split(",")):
            # off and on alternate, `--repeats` times each: load that drifts hits both alike
            t_off, t_on, drafted, accepted, same = [], [], 0, 0, True
            for _ in range(args.repeats):
                off, t, *_ = run(args.model, prompts, rows, "off", args.max_tokens, 0)
                t_off.append(t)
                on, t, d, a, fit = run(
                    args.model, prompts, rows, "ngram", args.max_tokens, args.spec_tokens
                )
                t_on.append(t)
                if args.fit:
                    print(f"<!-- {name} c={rows} ngram: {json.dumps(fit)} -->", flush=True)
                drafted, accepted, same = drafted + d, accepted + a, same and on == off
            n_off, n_on = sum(map(len, off)), sum(map(len, on))
            s_off, s_on = statistics.median(t_off), statistics.median(t_on)
            rate = f"{accepted}/{drafted} ({accepted / max(drafted, 1):.0%})"
            print(
                f"| {name} | {rows} | {n_off / s_off:.1f} | {n_on / s_on:.1f} | "
                f"{s_off / s_on:.2f}x | {rate} | {same} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
