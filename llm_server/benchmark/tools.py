"""Tool-call grammar cost: P plain rows beside T forced tool-call rows, in-process, greedy.

    python -m llm_server.native.blas python -m llm_server.benchmark.tools [--model PATH] [--rounds 2]

Prints wall time of 8 plain rows vs 4 tool rows + 4 plain rows (alternating rounds, the same
prompts), the grammar mask cost per token per constrained row, and one call as the model wrote it.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from llm_server.api.chat.plan import plan_chat
from llm_server.api.shared.schemas import parse_chat
from llm_server.scheduler import TokenEvent
from llm_server.service import ModelService

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "days"],
                "additionalProperties": False,
            },
        },
    }
]


async def _round(
    svc: ModelService, n_tool: int, n_plain: int, tokens: int
) -> tuple[float, float, str]:
    """Seconds for the round, mask ms per token per tool row, the first tool row's text."""
    handles, constraints = [], []
    for i in range(n_tool + n_plain):
        body = {
            "messages": [{"role": "user", "content": f"What is the weather in city number {i}?"}],
            "max_tokens": tokens,
            "temperature": 0,
        }
        if i < n_tool:
            body.update(tools=TOOLS, tool_choice="required")
        chat = parse_chat(body, tokens)
        plan = await plan_chat(svc, chat)
        constraints += [plan.constraint] if plan.constraint is not None else []
        handles.append(
            svc.start_generation(plan.prompt, chat.params, plan.constraint, plan.keep_tokens)
        )
    texts = [""] * len(handles)

    async def drain(i: int) -> None:
        async for ev in handles[i].events():
            if isinstance(ev, TokenEvent):
                texts[i] += ev.text

    t0 = time.perf_counter()
    await asyncio.gather(*(drain(i) for i in range(len(handles))))
    seconds = time.perf_counter() - t0
    steps = sum(c.steps for c in constraints)
    mask_ms = 1e3 * sum(c.mask_seconds for c in constraints) / steps if steps else 0.0
    return seconds, mask_ms, texts[0] if n_tool else ""


async def _main(model: Path, rounds: int, tokens: int) -> None:
    from llm_server.testing.live import tiny_service

    svc = tiny_service(model, concurrent=8, tool_parser="hermes")
    try:
        await _round(svc, 0, 8, 8)  # warm-up
        for _ in range(rounds):
            for label, n_tool in (("8 plain", 0), ("4 tool + 4 plain", 4)):
                seconds, mask_ms, text = await _round(svc, n_tool, 8 - n_tool, tokens)
                print(f"{label:18s} {seconds:6.2f} s   mask {mask_ms:.2f} ms/token/tool row")
        print("a tool row wrote:", repr(text))
    finally:
        svc.close(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, help="default: the embedded SmolLM2-135M")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args()
    if args.model is None:
        from llm_server.default_model import default_model_path

        args.model = default_model_path()
    asyncio.run(_main(args.model, args.rounds, args.max_tokens))


if __name__ == "__main__":
    main()
