"""Constrained decoding cost: step time with and without a schema row, and batched vs exclusive mode.

Runs in-process on `ModelService` (no HTTP), greedy, one fresh service per mode:
  1. step time: 4 plain rows, then 3 plain rows + 1 JSON-schema row (per-row mask cost);
  2. mixed load: P plain + S schema requests at --concurrent-requests C, aggregate throughput
     in `--constrained-mode batched` and `exclusive` (the seed design: schema requests run alone).
Writes constrained.json and constrained.md under --out and prints the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from llm_server.decoding import SamplingParams
from llm_server.scheduler import TokenEvent
from llm_server.service import ModelService
from llm_server.tools.constrained import JsonConstraint, build_constraint

PLAIN_PROMPTS = [
    "Explain why the sky is blue.",
    "Write a short poem about the sea.",
    "What are the benefits of exercise?",
    "Describe how a bicycle works.",
    "Give some tips for learning a new language.",
    "What is the capital of France?",
]
SCHEMA_CASES = [
    ("Describe a person with a name, an age and a city.",
     {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
      "properties": {"name": {"type": "string", "maxLength": 24},
                     "age": {"type": "integer", "minimum": 0, "maximum": 120},
                     "city": {"type": "string", "maxLength": 24}}}),
    ("List three fruits and their colours.",
     {"type": "object", "additionalProperties": False, "required": ["fruits"],
      "properties": {"fruits": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
          "type": "object", "additionalProperties": False, "required": ["name", "color"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "color": {"enum": ["red", "yellow", "green", "orange", "purple"]}}}}}}),
]  # fmt: skip
ROUNDS = 3  # alternating plain / with-schema phases in the step-time measurement
# A schema row that keeps running for the whole step-time phase (a long list of strings).
LONG_SCHEMA = {
    "type": "object",
    "required": ["words"],
    "properties": {"words": {"type": "array", "minItems": 200, "items": {"type": "string"}}},
}


@dataclass(frozen=True)
class StepTimes:
    plain_ms: float  # median decode step, 4 plain rows
    with_schema_ms: float  # median decode step, 3 plain rows + 1 schema row
    mask_ms: float  # mean per-step mask computation + application for the schema row
    steps: int  # steps measured in each phase


@dataclass(frozen=True)
class MixedLoad:
    mode: str  # "batched" | "exclusive"
    wall_s: float
    completion_tokens: int
    tokens_per_s: float  # aggregate: all completion tokens / wall time
    plain_latency_s: float  # mean end-to-end latency of the plain requests
    schema_latency_s: float
    schema_valid: int  # schema answers that parsed as JSON and stopped (not at the limit)
    schema_mask_ms: float  # mean mask computation + application per schema token


def _service(model: Path, concurrent: int, mode: str) -> ModelService:
    from llm_server.testing.live import tiny_service

    svc = tiny_service(model, concurrent, constrained_mode=mode)
    # Build (and cache) the llguidance tokenizer now so no measurement pays for it.
    build_constraint({"type": "json_object"}, svc.tokenizer, svc.engine.vocab_size)
    return svc


async def _request(svc: ModelService, content: str, max_tokens: int, fmt: dict | None = None,
                   ignore_eos: bool = False) -> tuple[str, int, str, float, JsonConstraint | None]:  # fmt: skip
    t0 = time.perf_counter()
    prompt = svc.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    constraint = build_constraint(fmt, svc.tokenizer, svc.engine.vocab_size) if fmt else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    handle = svc.start_generation(prompt, params, constraint)
    text = ""
    async for ev in handle.events():
        if isinstance(ev, TokenEvent):
            text += ev.text
    fin = handle.finish
    return text, fin.completion_tokens, fin.reason.value, time.perf_counter() - t0, constraint


def measure_step_times(model: Path, tokens: int) -> StepTimes:
    """Median step time of 4 plain rows vs 3 plain + 1 schema row (batched mode)."""
    svc = _service(model, 4, "batched")
    steps: list[tuple[float, int]] = []
    svc.scheduler.add_step_listener(lambda dt, rows: steps.append((dt, rows)))
    fmt = {"type": "json_schema", "json_schema": {"name": "words", "schema": LONG_SCHEMA}}

    async def phase(n_schema: int) -> JsonConstraint | None:
        jobs = [
            _request(svc, PLAIN_PROMPTS[i], tokens, ignore_eos=True) for i in range(4 - n_schema)
        ]
        jobs += [_request(svc, "List many English words.", tokens, fmt) for _ in range(n_schema)]
        results = await asyncio.gather(*jobs)
        return results[-1][4]  # the schema row's constraint (None without one)

    plain: list[float] = []
    mixed: list[float] = []
    masks: list[JsonConstraint] = []
    try:
        asyncio.run(phase(0))  # warm-up
        for _ in range(ROUNDS):  # alternate, so drift in machine load hits both alike
            for n_schema, into in ((0, plain), (1, mixed)):
                steps.clear()
                constraint = asyncio.run(phase(n_schema))
                into += [dt for dt, rows in steps if rows == 4]  # every row runs to the limit
                if constraint is not None:
                    masks.append(constraint)
    finally:
        svc.close(30)
    return StepTimes(
        plain_ms=statistics.median(plain) * 1e3,
        with_schema_ms=statistics.median(mixed) * 1e3,
        mask_ms=sum(c.mask_seconds for c in masks) / max(sum(c.steps for c in masks), 1) * 1e3,
        steps=min(len(plain), len(mixed)),
    )


def measure_mixed_load(model: Path, mode: str, concurrent: int, n_plain: int, n_schema: int,
                       plain_tokens: int, schema_tokens: int) -> MixedLoad:  # fmt: skip
    """Plain and schema requests interleaved, all submitted at once."""
    svc = _service(model, concurrent, mode)
    every = max(1, (n_plain + n_schema) // max(n_schema, 1))
    plan: list[tuple[str, int, dict | None]] = []
    p = s = 0
    while p < n_plain or s < n_schema:
        if s < n_schema and (len(plan) % every == 0 or p >= n_plain):
            prompt, schema = SCHEMA_CASES[s % len(SCHEMA_CASES)]
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{s}", "schema": schema}}
            plan.append((prompt, schema_tokens, fmt))
            s += 1
        else:
            plan.append((PLAIN_PROMPTS[p % len(PLAIN_PROMPTS)], plain_tokens, None))
            p += 1

    async def run() -> list:
        return await asyncio.gather(*(_request(svc, c, n, f) for c, n, f in plan))

    try:
        asyncio.run(_request(svc, "Hi.", 4))  # warm-up
        t0 = time.perf_counter()
        results = asyncio.run(run())
        wall = time.perf_counter() - t0
    finally:
        svc.close(30)
    plain_lat = [r[3] for (_, _, f), r in zip(plan, results, strict=True) if f is None]
    schema = [r for (_, _, f), r in zip(plan, results, strict=True) if f is not None]
    tokens = sum(r[1] for r in results)
    return MixedLoad(
        mode=mode,
        wall_s=wall,
        completion_tokens=tokens,
        tokens_per_s=tokens / wall,
        plain_latency_s=statistics.mean(plain_lat) if plain_lat else 0.0,
        schema_latency_s=statistics.mean(r[3] for r in schema) if schema else 0.0,
        schema_valid=sum(1 for r in schema if r[2] == "stop" and _parses(r[0])),
        schema_mask_ms=sum(r[4].mask_seconds for r in schema)
        / max(sum(r[4].steps for r in schema), 1)
        * 1e3,
    )


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def render(steps: StepTimes, loads: list[MixedLoad], setup: dict) -> str:
    lines = [
        "# Constrained decoding",
        "",
        f"Setup: {json.dumps(setup)}",
        "",
        "| decode step (4 rows) | median ms |",
        "|---|---|",
        f"| 4 plain rows | {steps.plain_ms:.1f} |",
        f"| 3 plain + 1 schema row | {steps.with_schema_ms:.1f} |",
        f"| of which schema mask (per step) | {steps.mask_ms:.2f} |",
        "",
        "| mode | wall s | tokens | tok/s | plain latency s | schema latency s | schema valid "
        "| mask ms/token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in loads:
        lines.append(
            f"| {m.mode} | {m.wall_s:.1f} | {m.completion_tokens} | {m.tokens_per_s:.1f} | "
            f"{m.plain_latency_s:.1f} | {m.schema_latency_s:.1f} | "
            f"{m.schema_valid}/{setup['schema_requests']} | {m.schema_mask_ms:.2f} |"
        )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llm-benchmark-constrained", description=__doc__)
    p.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument(
        "--out", help="folder for constrained.json / constrained.md (default: print only)"
    )
    p.add_argument(
        "--quick", action="store_true", help="a small smoke run (fewer, shorter requests)"
    )
    p.add_argument("--concurrent-requests", type=int, default=4)
    p.add_argument("--plain", type=int, default=12, help="plain requests in the mixed load")
    p.add_argument("--schema", type=int, default=4, help="schema requests in the mixed load")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per plain request")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model:
        model = Path(args.model).expanduser()
    else:
        from llm_server.default_model import default_model_path

        model = default_model_path()
    plain, schema, tokens = args.plain, args.schema, args.max_tokens
    if args.quick:
        plain, schema, tokens = min(plain, 4), min(schema, 2), min(tokens, 12)
    setup = {"model": model.name, "concurrent_requests": args.concurrent_requests,
             "plain_requests": plain, "schema_requests": schema, "plain_max_tokens": tokens,
             "schema_max_tokens": 2 * tokens}  # fmt: skip
    steps = measure_step_times(model, max(tokens // 2, 16))
    loads = [
        measure_mixed_load(model, mode, args.concurrent_requests, plain, schema, tokens, 2 * tokens)
        for mode in ("batched", "exclusive")
    ]
    report = render(steps, loads, setup)
    print(report)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        data = {
            "setup": setup,
            "step_times": asdict(steps),
            "mixed_load": [asdict(m) for m in loads],
        }
        (out / "constrained.json").write_text(json.dumps(data, indent=2) + "\n")
        (out / "constrained.md").write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
