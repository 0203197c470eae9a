"""The vision workload: a fixed set of generated images, each with a question, streamed as
Chat Completions requests with `image_url` data URLs, against our server and `mlx_vlm.server`
on the same checkpoint, one server at a time, alternating, at each concurrency.

    llm-benchmark --workload vision --model VLM_FOLDER --concurrency 1,4,8

Reported per server and concurrency: generated tokens per second (completion tokens over the
load's wall time), TTFT p50/p90, and the ratio ours / mlx_vlm.server. Our server's vision-tower
time per image comes from its `/metrics` (`llm_server_vision_encode_seconds_total` over
`llm_server_vision_images_total`), read before and after each load.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from llm_server.benchmark import load, servers
from llm_server.benchmark.settings import Settings

IMAGES = 8  # distinct images; requests cycle over them
SIDE = 448  # pixels per side of each generated image
WARM_FIRST = 1000  # the warm-up's images: never among the load's
COLORS = [(220, 40, 40), (40, 160, 60), (40, 80, 220), (230, 200, 40), (150, 60, 200), (30, 30, 30)]
QUESTIONS = [
    "What shapes are in this picture, and what colors are they?",
    "Describe this image in one sentence.",
    "How many shapes do you see? Answer briefly.",
    "Which color covers most of this picture?",
]


def image_png(index: int) -> bytes:
    """A deterministic picture: a tinted background with three shapes, PNG bytes."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(1000 + index)
    bg = tuple(int(v) for v in rng.integers(180, 256, 3))
    img = Image.new("RGB", (SIDE, SIDE), bg)
    draw = ImageDraw.Draw(img)
    for k in range(3):
        x0, y0 = (int(v) for v in rng.integers(0, SIDE - 160, 2))
        size = int(rng.integers(60, 160))
        color = COLORS[(index + k) % len(COLORS)]
        box = (x0, y0, x0 + size, y0 + size)
        (draw.ellipse if (index + k) % 2 else draw.rectangle)(box, fill=color)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def vision_prompts(count: int = IMAGES, first: int = 0) -> list[load.Prompt]:
    """`count` chat prompts, each one user turn with an image part then a question (images
    `first`, `first + 1`, ...)."""
    out = []
    for i in range(first, first + count):
        url = "data:image/png;base64," + base64.b64encode(image_png(i)).decode()
        content = [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": QUESTIONS[i % len(QUESTIONS)]},
        ]
        out.append(load.Prompt(f"image-{i}", [{"role": "user", "content": content}]))
    return out


_METRIC = re.compile(r"^llm_server_vision_(encode_seconds|images)_total\s+(\S+)$", re.M)


def tower_seconds(url: str) -> tuple[float, float] | None:
    """(seconds, images) our server's vision tower has spent so far, from /metrics."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10.0, trust_env=False).text
    except httpx.HTTPError:
        return None
    found = {kind: float(value) for kind, value in _METRIC.findall(text)}
    if "encode_seconds" not in found or "images" not in found:
        return None
    return found["encode_seconds"], found["images"]


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def _load(
    url: str, prompts, c: int, requests: int, max_tokens: int, count, model: str | None
) -> load.LoadResult:
    """load.run_load's streams, with `model` in each body (mlx_vlm.server requires it; ours
    serves the one model it loaded)."""
    gate = asyncio.Semaphore(c)
    records = [load.RequestRecord(i, prompts[i % len(prompts)].id) for i in range(requests)]
    async with httpx.AsyncClient(trust_env=False, timeout=load.REQUEST_TIMEOUT_S) as client:
        t0 = time.perf_counter()

        async def one(rec: load.RequestRecord) -> None:
            body = load.chat_body(prompts[rec.index % len(prompts)].messages, max_tokens)
            if model is not None:
                body["model"] = model
            async with gate:
                await load._stream_one(client, url, body, rec, t0, count)

        await asyncio.gather(*(one(r) for r in records))
    wall = max(r.end_s for r in records) - min(r.start_s for r in records)
    return load.LoadResult(c, max_tokens, wall, records)


def _one(s: Settings, kind: str, c: int, prompts, count) -> dict:
    spec = servers.ServerSpec(kind, s.model, c, max_queued=max(s.requests, c))
    log = s.out / "logs" / f"vision-{kind}-c{c}.log"
    model = str(s.model) if kind == "mlx_vlm" else None
    with servers.running(spec, log) as srv:
        # warm-up: c requests at once with images outside the set (loads, compiles shapes,
        # runs the tower), so every image of the load goes through the tower once there
        warm_prompts = vision_prompts(c, first=WARM_FIRST)
        warm = asyncio.run(_load(srv.url, warm_prompts, c, c, s.max_tokens, count, model))
        failed = [r.error for r in warm.records if not r.ok]
        if failed:
            raise RuntimeError(f"{kind} warm-up failed: {failed[0][:160]}")
        before = tower_seconds(srv.url) if kind == "ours" else None
        result = asyncio.run(_load(srv.url, prompts, c, s.requests, s.max_tokens, count, model))
        after = tower_seconds(srv.url) if kind == "ours" else None
    ok = [r for r in result.records if r.ok]
    tokens = sum(r.completion_tokens for r in ok)
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    run = {
        "requests": len(result.records),
        "failed": len(result.records) - len(ok),
        "errors": [r.error for r in result.records if not r.ok][:3],
        "completion_tokens": tokens,
        "wall_s": result.wall_s,
        "tokens_per_s": tokens / result.wall_s if result.wall_s > 0 else None,
        "ttft_p50_s": _pct(ttfts, 50),
        "ttft_p90_s": _pct(ttfts, 90),
        "texts": [r.text for r in result.records],
    }
    if before is not None and after is not None and after[1] > before[1]:
        run["tower_s_per_image"] = (after[0] - before[0]) / (after[1] - before[1])
    return run


def run_vision(s: Settings) -> str:
    """Both servers at every concurrency (order alternating); writes vision.json, returns the
    markdown table."""
    from llm_server.benchmark.runner import _tokenizer

    s.out.mkdir(parents=True, exist_ok=True)
    tok = _tokenizer(s.model)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    prompts = vision_prompts()
    kinds = ["ours", "mlx_vlm"] if s.mlx_lm else ["ours"]
    runs: dict[str, dict[int, dict]] = {}
    for i, c in enumerate(s.concurrencies):
        for kind in kinds if i % 2 == 0 else kinds[::-1]:
            print(f"llm-benchmark: vision, {kind} at concurrency {c}", file=sys.stderr)
            try:
                runs.setdefault(kind, {})[c] = _one(s, kind, c, prompts, count)
            except (servers.ServerStartError, RuntimeError, OSError) as exc:
                runs.setdefault(kind, {})[c] = {"error": str(exc)}
    (s.out / "vision.json").write_text(json.dumps(
        {"model": str(s.model), "requests": s.requests, "max_tokens": s.max_tokens,
         "images": IMAGES, "side": SIDE, "runs": runs}, indent=1))  # fmt: skip
    return table(runs, s)


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(runs: dict[str, dict[int, dict]], s: Settings) -> str:
    """The markdown report: tokens/s, TTFT and the ratio per concurrency."""
    lines = [
        f"Vision workload: {IMAGES} generated {SIDE}x{SIDE} PNG images with a question each, "
        f"{s.requests} streamed greedy requests of at most {s.max_tokens} tokens per run, "
        f"model {s.model}.",
        "",
        "| concurrency | ours tok/s | mlx_vlm.server tok/s | ratio | ours TTFT p50 s "
        "| mlx_vlm TTFT p50 s | ours tower s/image | failed (ours/theirs) |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in s.concurrencies:
        ours = runs.get("ours", {}).get(c, {})
        theirs = runs.get("mlx_vlm", {}).get(c, {})
        a, b = ours.get("tokens_per_s"), theirs.get("tokens_per_s")
        ratio = a / b if a and b else None
        lines.append(
            f"| {c} | {_f(a, '.1f')} | {_f(b, '.1f')} | {_f(ratio, '.2f')}{'x' if ratio else ''} "
            f"| {_f(ours.get('ttft_p50_s'), '.2f')} | {_f(theirs.get('ttft_p50_s'), '.2f')} "
            f"| {_f(ours.get('tower_s_per_image'), '.3f')} "
            f"| {ours.get('failed', ours.get('error', '-'))} / "
            f"{theirs.get('failed', theirs.get('error', '-'))} |"
        )
    return "\n".join(lines)


def model_is_vision(model: Path) -> bool:
    """Whether the checkpoint's config names a vision part (what the workload needs)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return "vision_config" in config
