"""Embedding throughput: inputs of 20-200 tokens through `/v1/embeddings`.

Three ways to send the same inputs to one server: one request carrying all of them (padded
batches on the embedding pump), one request per input from several client threads at once
(the pump batches what is queued), and one request per input, one after another. Inputs are
token-id lists cut from the benchmark's chat texts (scoring.scoring_prompts), so lengths are
exact. Reports inputs/s and tokens/s per mode and the largest difference between a vector
from a batch and the same input sent alone.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import numpy as np

TIMEOUT_S = 900.0


class EmbeddingBenchError(RuntimeError):
    """The server's embeddings route failed or answered in an unexpected shape."""


@dataclass(frozen=True)
class EmbeddingMode:
    name: str  # "batched" | "concurrent" | "sequential"
    requests: int
    wall_s: float  # best of the repeats
    inputs: int
    tokens: int

    @property
    def inputs_per_s(self) -> float:
        return self.inputs / self.wall_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


@dataclass(frozen=True)
class EmbeddingBenchResult:
    model: str
    server_concurrency: int
    lengths: list[int]
    modes: list[EmbeddingMode]
    max_abs_diff: float  # batched vs sequential vectors (the last repeat of each)
    repeats: int

    def to_dict(self) -> dict:
        out = asdict(self)
        for m, d in zip(self.modes, out["modes"], strict=True):
            d |= {"inputs_per_s": m.inputs_per_s, "tokens_per_s": m.tokens_per_s}
        return out

    def markdown(self) -> str:
        base = next(m for m in self.modes if m.name == "sequential")
        lines = [
            f"## Embeddings ({len(self.lengths)} inputs of {min(self.lengths)}-"
            f"{max(self.lengths)} tokens, {sum(self.lengths)} tokens; server "
            f"--concurrent-requests {self.server_concurrency}; best of {self.repeats})",
            "",
            "| mode | requests | wall s | inputs/s | tokens/s | vs sequential |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for m in self.modes:
            lines.append(
                f"| {m.name} | {m.requests} | {m.wall_s:.2f} | {m.inputs_per_s:.1f} | "
                f"{m.tokens_per_s:.0f} | {m.tokens_per_s / base.tokens_per_s:.2f}x |"
            )
        lines += ["", f"max |batched - sequential| = {self.max_abs_diff:.2e}"]
        return "\n".join(lines)


def _embed(client: httpx.Client, url: str, inputs: list[list[int]]) -> np.ndarray:
    resp = client.post(f"{url}/v1/embeddings", json={"input": inputs, "encoding_format": "float"})
    if resp.status_code != 200:
        raise EmbeddingBenchError(f"/v1/embeddings answered {resp.status_code}: {resp.text[:300]}")
    data = sorted(resp.json()["data"], key=lambda d: d["index"])
    if len(data) != len(inputs):
        raise EmbeddingBenchError(f"{len(inputs)} inputs sent, {len(data)} vectors came back")
    return np.array([d["embedding"] for d in data], dtype=np.float32)


def run_embeddings(
    url: str, inputs: list[list[int]], concurrency: int, repeats: int, model: str = ""
) -> EmbeddingBenchResult:
    """Time the three modes `repeats` times each (best kept)."""
    tokens = sum(len(i) for i in inputs)
    n = len(inputs)
    best = {"batched": float("inf"), "concurrent": float("inf"), "sequential": float("inf")}
    with httpx.Client(trust_env=False, timeout=TIMEOUT_S) as client:
        _embed(client, url, [inputs[0]])  # warm-up

        def one(i: int) -> np.ndarray:
            return _embed(client, url, [inputs[i]])[0]

        def concurrent() -> np.ndarray:
            with ThreadPoolExecutor(concurrency) as pool:
                return np.stack(list(pool.map(one, range(n))))

        runs = {
            "batched": lambda: _embed(client, url, inputs),
            "concurrent": concurrent,
            "sequential": lambda: np.stack([one(i) for i in range(n)]),
        }
        vectors: dict[str, np.ndarray] = {}
        order = list(runs)
        for r in range(repeats):
            # alternate the order, so load from elsewhere on the machine hits every mode alike
            for name in order if r % 2 == 0 else order[::-1]:
                t = time.perf_counter()
                vectors[name] = runs[name]()
                best[name] = min(best[name], time.perf_counter() - t)
    requests = {"batched": 1, "concurrent": n, "sequential": n}
    modes = [EmbeddingMode(k, requests[k], v, n, tokens) for k, v in best.items()]
    return EmbeddingBenchResult(
        model=model,
        server_concurrency=concurrency,
        lengths=[len(i) for i in inputs],
        modes=modes,
        max_abs_diff=float(np.abs(vectors["batched"] - vectors["sequential"]).max()),
        repeats=repeats,
    )


def benchmark_embeddings(
    model: Path, out: Path, count: int, concurrency: int, repeats: int
) -> EmbeddingBenchResult:
    """Start our server on `model`, run the embedding modes, write embeddings.json and .md."""
    from importlib import resources

    from tokenizers import Tokenizer

    from llm_server.benchmark import scoring, servers

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompts = json.loads(
        resources.files("llm_server.benchmark").joinpath("prompts.json").read_text()
    )["prompts"]
    texts = [m["content"] for p in prompts for m in p["messages"]]
    inputs = scoring.scoring_prompts(texts, lambda t: tok.encode(t).ids, count)
    spec = servers.ServerSpec("ours", model, concurrency, max_queued=count + concurrency)
    with servers.running(spec, out / "logs" / "ours-embeddings.log") as srv:
        result = run_embeddings(srv.url, inputs, concurrency, repeats, model.name)
    out.mkdir(parents=True, exist_ok=True)
    (out / "embeddings.json").write_text(json.dumps(result.to_dict(), indent=2))
    (out / "embeddings.md").write_text(result.markdown() + "\n")
    return result
