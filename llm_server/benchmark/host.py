"""The scheduler thread's time per decode step outside the forward (sampling, detokenizing,
stop matching, emitting events), measured on the real service without HTTP.

    python -m llm_server.native.blas python -m llm_server.benchmark.host [--model DIR] [--concurrency 1,4]

Each decode step's time comes from a scheduler step listener; the forward's from the
engine's `decode`; `Decoder.step` (sampling + detokenization + stop matching) is timed per
call. What is left is the scheduler's own bookkeeping and handing events to the event loop.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from dataclasses import dataclass, field

from llm_server.benchmark.settings import probe_parser

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class _Probe:
    """Times gathered on the scheduler thread."""

    forward_ms: list[float] = field(default_factory=list)  # one per decode step
    decoder_ms: list[float] = field(default_factory=list)  # Decoder.step per decode step
    step_ms: list[float] = field(default_factory=list)  # whole decode steps (step listener)
    rows: list[int] = field(default_factory=list)
    _decoder_now: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(frozen=True)
class HostTimes:
    concurrency: int
    steps: int
    step_ms: float  # medians over decode steps
    forward_ms: float
    host_ms: float  # step - forward
    decoder_ms: float  # of which Decoder.step (all rows)
    argmax_us: float  # numpy argmax over one row's logits (what greedy sampling costs)


def _timed_engine_factory(model, rows: int, probe: _Probe):
    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings

    def factory():
        engine = MLXEngine(model, EngineSettings(rows=rows))
        pipeline = engine.decoder  # the part every decode step goes through (mlx_decode.py)
        decode = pipeline.decode

        def timed_decode(rows_, tokens):
            probe._decoder_now = 0.0  # Decoder.step calls from here on belong to this step
            start = time.perf_counter()
            out = decode(rows_, tokens)
            probe.forward_ms.append((time.perf_counter() - start) * 1e3)
            return out

        pipeline.decode = timed_decode
        engine.pipelined = False  # the steps above are the ones that run (CPU default)
        return engine

    return factory


def _patch_decoder(probe: _Probe):
    """Time Decoder.step (restored by the returned function)."""
    from llm_server import decoding

    original = decoding.Decoder.step

    def step(self, logits, room):
        start = time.perf_counter()
        try:
            return original(self, logits, room)
        finally:
            probe._decoder_now += (time.perf_counter() - start) * 1e3

    decoding.Decoder.step = step
    return lambda: setattr(decoding.Decoder, "step", original)


async def _load(svc, concurrency: int, requests: int, max_tokens: int) -> None:
    from llm_server.decoding import SamplingParams

    prompt = svc.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            handle = svc.start_generation(prompt + [i % 7 + 100], params)
            async for _ in handle.events():
                pass

    await asyncio.gather(*(one(i) for i in range(requests)))


def measure(model, concurrency: int, requests: int, max_tokens: int) -> HostTimes:
    import numpy as np

    from llm_server.server import make_service
    from llm_server.settings import ServerSettings

    probe = _Probe()
    restore = _patch_decoder(probe)
    factory = _timed_engine_factory(model, concurrency, probe)
    settings = ServerSettings().replace(rows=concurrency, max_queued=requests)
    svc = make_service(settings, model, engine_factory=factory)
    try:
        svc.wait_ready(300)

        def on_step(elapsed: float, rows: int) -> None:
            probe.step_ms.append(elapsed * 1e3)
            probe.decoder_ms.append(probe._decoder_now)
            probe.rows.append(rows)

        svc.scheduler.add_step_listener(on_step)
        asyncio.run(_load(svc, concurrency, requests, max_tokens))
    finally:
        restore()
        svc.close(60)
    n = min(len(probe.step_ms), len(probe.forward_ms))
    step, fwd = probe.step_ms[:n], probe.forward_ms[:n]
    logits = np.random.default_rng(0).standard_normal(svc.engine.vocab_size).astype(np.float32)
    start = time.perf_counter()
    for _ in range(1000):
        np.argmax(logits)
    argmax_us = (time.perf_counter() - start) * 1e3
    med = statistics.median
    return HostTimes(
        concurrency=concurrency,
        steps=n,
        step_ms=med(step),
        forward_ms=med(fwd),
        host_ms=med([s - f for s, f in zip(step, fwd, strict=True)]),
        decoder_ms=med(probe.decoder_ms[:n]),
        argmax_us=argmax_us,
    )


def main(argv: list[str] | None = None) -> None:
    p = probe_parser("host", __doc__)
    p.add_argument("--concurrency", default="1,4", help="comma-separated (default 1,4)")
    p.add_argument("--requests", type=int, default=8, help="requests per concurrency")
    p.add_argument("--max-tokens", type=int, default=48, help="new tokens per request")
    args = p.parse_args(argv)
    from llm_server.model_source import resolve_model

    model = resolve_model(args.model)
    print(
        "| concurrency | decode steps | step ms | forward ms | non-forward ms | "
        "of which Decoder.step ms | numpy argmax per row us |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for c in [int(v) for v in args.concurrency.split(",")]:
        t = measure(model, c, args.requests, args.max_tokens)
        print(
            f"| {t.concurrency} | {t.steps} | {t.step_ms:.1f} | {t.forward_ms:.1f} | "
            f"{t.host_ms:.2f} | {t.decoder_ms:.2f} | {t.argmax_us:.1f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
