"""Memory-bandwidth roofline for single-stream decode.

Each decode step reads every weight once, so tokens/s cannot exceed read bandwidth (bytes/s)
divided by the bytes of the weights. Bandwidth is measured by summing a large float32 array.
"""

from __future__ import annotations

import json
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GIB = 1 << 30
_HEADER_LEN = struct.Struct("<Q")  # safetensors: little-endian u64 header length, then JSON


@dataclass(frozen=True)
class Bandwidth:
    bytes_per_s: float
    array_bytes: int
    threads: int  # best of 1 thread and one per core
    repeats: int


def weight_bytes(model: Path) -> int:
    """Bytes of all tensors in the model's `*.safetensors` files (from the headers; no loading)."""
    total = 0
    files = sorted(Path(model).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model}")
    for path in files:
        with open(path, "rb") as f:
            (n,) = _HEADER_LEN.unpack(f.read(_HEADER_LEN.size))
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                total += end - start
    return total


def _sum_time(parts: list[np.ndarray], pool: ThreadPoolExecutor | None) -> float:
    t = time.perf_counter()
    if pool is None:
        for p in parts:
            p.sum()
    else:
        list(pool.map(np.sum, parts))  # numpy releases the GIL inside large reductions
    return time.perf_counter() - t


def measure_bandwidth(array_bytes: int = GIB, repeats: int = 5) -> Bandwidth:
    """Read bandwidth: best time to sum a float32 array of `array_bytes`, 1 thread or all cores."""
    data = np.ones(array_bytes // 4, dtype=np.float32)  # ones: every page is really allocated
    cores = os.cpu_count() or 1
    best_rate, best_threads = 0.0, 1
    for threads in sorted({1, cores}):
        parts = np.array_split(data, threads)
        pool = ThreadPoolExecutor(threads) if threads > 1 else None
        try:
            _sum_time(parts, pool)  # first pass warms caches and the pool
            wall = min(_sum_time(parts, pool) for _ in range(repeats))
        finally:
            if pool is not None:
                pool.shutdown()
        rate = data.nbytes / wall
        if rate > best_rate:
            best_rate, best_threads = rate, threads
    del data
    return Bandwidth(best_rate, array_bytes, best_threads, repeats)
