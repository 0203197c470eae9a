"""GF/s of the skinny library's `x @ weight.T` products, one or more builds alternated in one run.

    python -m llm_server.benchmark.gemm_rate [--lib OLD.so --lib NEW.so] [--rows 1 4 128 ...]

Each build (default: this source's, `skinny.build()`) runs every (rows, K, N) product in turn,
`--repeats` rounds with the builds alternated inside each round, so a busy neighbour slows
them alike; the table gives each build's best round in GF/s (2 * M * N * K flops per product).
The outputs of every build are compared bit for bit (the library's one arithmetic per output).
Shapes: SmolLM2-135M's products, (K, N) = (576, 960), (576, 576), (576, 3072), (1536, 576).
"""

from __future__ import annotations

import argparse
import ctypes
import time

import numpy as np

from llm_server.native import skinny

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
ROWS = [1, 4, 8, 128, 512, 2048]


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    f, p, i = ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    lib.llm_skinny_sgemm.argtypes = [i, i, i, i, f, p, i, p, i, f, p, i]
    lib.llm_skinny_sgemm.restype = None
    return lib


def timed(lib, a, w, out, min_s: float) -> float:
    """Seconds per product: the best of runs totalling at least `min_s`."""
    m, k = a.shape
    n = w.shape[0]
    args = (1, m, n, k, 1.0, a.ctypes.data, k, w.ctypes.data, k, 0.0, out.ctypes.data, n)
    lib.llm_skinny_sgemm(*args)
    best, spent = float("inf"), 0.0
    while spent < min_s:
        t = time.perf_counter()
        lib.llm_skinny_sgemm(*args)
        dt = time.perf_counter() - t
        best, spent = min(best, dt), spent + dt
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", action="append", help="a built library (repeatable)")
    ap.add_argument("--rows", type=int, nargs="+", default=ROWS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-s", type=float, default=0.05, help="time per product per round")
    args = ap.parse_args(argv)
    paths = args.lib or [str(skinny.build())]
    libs = [load(p) for p in paths]
    rng = np.random.default_rng(0)
    print("rows     K     N  " + "  ".join(f"GF/s[{i}]" for i in range(len(libs))))
    for m in args.rows:
        for k, n in SHAPES:
            a = rng.standard_normal((m, k)).astype(np.float32)
            w = rng.standard_normal((n, k)).astype(np.float32)
            outs = [np.empty((m, n), np.float32) for _ in libs]
            best = [float("inf")] * len(libs)
            for _ in range(args.repeats):
                for i, lib in enumerate(libs):
                    best[i] = min(best[i], timed(lib, a, w, outs[i], args.min_s))
            same = all(np.array_equal(o, outs[0]) for o in outs)
            rates = "  ".join(f"{2 * m * n * k / t / 1e9:8.1f}" for t in best)
            print(f"{m:4d} {k:5d} {n:5d}  {rates}{'' if same else '  OUTPUTS DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
