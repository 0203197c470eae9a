"""One layer's attention op (decode_ops' `attend`) timed for builds side by side, alternated.

    python -m llm_server.benchmark.attention_kernel [BUILD.so ...] [--repeats N]

Each build is a compiled `_llm_decode_ops` (decode_ops.build() writes it under the cache
folder; copy an older one aside to compare); none given: the current build. Cases in SmolLM2's
geometry (9 query heads over 3 KV heads, Dh 64): a 512-position prompt chunk at offset 7,488, a
2,048-position chunk at offset 0, a 20-position chunk at 3,700 (an agent's turn) and a decode
step of 4 rows at 4,096 positions. The builds run
in turn within each repeat (a shared host's load falls on all alike); the median per case is
printed with the outputs' agreement (the arithmetic is fixed: builds must agree bit for bit).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time

import mlx.core as mx
import numpy as np

from llm_server.native import decode_ops

HEADS, KV, DH = 9, 3, 64
CASES = {  # name: (q, rows' positions)
    "chunk 512 at 7488": (512, [7488]),
    "chunk 2048 at 0": (2048, [0]),
    "chunk 20 at 3700": (20, [3700]),  # an agent's turn over its cached conversation
    "decode 4 rows at 4096": (1, [4096, 4100, 4090, 4095]),
}


def load(path: str):
    spec = importlib.util.spec_from_file_location("_llm_decode_ops", path)
    ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ops)
    return ops


def inputs(q: int, pos: list[int]):
    rng = np.random.default_rng(0)
    capacity = max(pos) + q
    store = (len(pos), KV, capacity, DH)
    qkv = mx.array(rng.standard_normal((len(pos) * q, (HEADS + 2 * KV) * DH)).astype(np.float32))
    keys = mx.array(rng.standard_normal(store).astype(np.float32))
    values = mx.array(rng.standard_normal(store).astype(np.float32))
    angles = rng.random((capacity, DH // 2)).astype(np.float32) * 3
    cos2 = mx.array(np.concatenate([np.cos(angles)] * 2, axis=1))
    sin2 = mx.array(np.concatenate([-np.sin(angles), np.sin(angles)], axis=1))
    rows, at = mx.arange(len(pos), dtype=mx.int32), mx.array(pos, dtype=mx.int32)
    mx.eval(qkv, keys, values, cos2, sin2)
    return qkv, keys, values, rows, at, cos2, sin2, HEADS, KV, DH, q, 0.125


def timed(ops, args) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    out = ops.attend(*args)
    mx.eval(out)
    return time.perf_counter() - start, np.array(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="*", help="compiled _llm_decode_ops files")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    builds = {p: load(p) for p in args.builds} or {"current": decode_ops.module()}
    for name, (q, pos) in CASES.items():
        case = inputs(q, pos)
        times: dict[str, list[float]] = {p: [] for p in builds}
        outs = {p: timed(ops, case)[1] for p, ops in builds.items()}  # warm-up
        for _ in range(args.repeats):
            for path, ops in builds.items():
                times[path].append(timed(ops, case)[0])
        first = next(iter(outs.values()))
        same = all(np.array_equal(o, first) for o in outs.values())
        medians = "  ".join(f"{statistics.median(t) * 1e3:8.2f} ms" for t in times.values())
        print(f"{name:24s} {medians}   outputs identical: {same}")


if __name__ == "__main__":
    main()
