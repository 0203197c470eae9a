"""Disk tier of the prefix cache (`--prefix-cache-dir`): entries evicted from memory, and every
resident entry at shutdown, kept as files that survive restarts, bounded in bytes.

Files live in DIR/<fingerprint>/, the fingerprint covering the checkpoint (config and weight
files' names, sizes and times), the dtype, the kernel set, the fused forward, quantization and
the MLX version: an entry written by another model or build is never read (its folder is only
deleted, oldest first, to stay under the bound). One file an entry: magic, a JSON header
(fingerprint, shapes, dtype, CRC-32 of everything after it), the token ids (int64: embedding
spans' keys are negative; int32 in files of the first version, still read), then each layer's
keys and values, then (a model with recurrent layers) each state checkpoint's arrays, their
positions and shapes in the header (`marks`). The token ids of
every file are indexed in memory at start; the KV is read on a match worth its read (at least
`READ_TOKENS` shared, or an eighth of the file's: a chat template's opening tokens never pull a
long conversation's file in), and a file whose checksum, header or size is wrong is skipped
with one warning, deleted, and never served.
Writes run on a background thread (the scheduler thread only hands over the arrays).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import queue
import shutil
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from llm_server import fingerprint as fp

log = logging.getLogger(__name__)

MAGIC = b"LLMPKV2\n"  # token ids as int64 (a server that reads only version 1 skips these)
MAGIC_V1 = b"LLMPKV1\n"  # token ids as int32
_TOKEN_BYTES = {MAGIC: 8, MAGIC_V1: 4}
SUFFIX = ".kv"
# a read shares at least this many tokens or an eighth of the file's: reading a position (its
# checksum and a copy, ~0.05 ms for SmolLM2 on 2 cores) costs ~1% of prefilling one, yet
# SmolLM2's template's opening tokens alone once read a 3.8k-token file (177 MB, 0.6 s)
READ_TOKENS = 256
DEFAULT_DISK_BYTES = 16 << 30  # at most half the free space of the folder's disk at start
# bf16 as its bits; uint32: a quantized KV format's packed words, scales and biases (kv/format.py)
_NP = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "uint32": np.uint32}


def checkpoint_digest(path: Path) -> str:
    """The checkpoint's identity: its config and weight files' names, sizes and times, and
    config.json's text."""
    path = Path(path)
    files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors"))
    ident = hashlib.sha256()
    for p in files:
        st = p.stat()
        ident.update(f"{p.name}:{st.st_size}:{st.st_mtime_ns};".encode())
    ident.update((path / "config.json").read_bytes())
    return ident.hexdigest()


def engine_fingerprint(
    checkpoint: str,
    dtype: str,
    kernels: str,
    fused: bool,
    quantized: bool,
    mlx_version: str = mx.__version__,
    state_layout: str = "",
    kv_format: str = "",
) -> str:
    """What the KV depends on: the checkpoint (`checkpoint_digest`), the compute dtype, the
    kernel set's name, whether the fused forward computes it, whether quantized layers serve
    it (kept quantized, not dequantized at load) and the MLX version; `state_layout`: what a
    state checkpoint holds (the recurrent layers and their arrays; "" without any);
    `kv_format`: the KV store's format where it is not the compute dtype (kv/format.py:
    `KVFormat.name`, "" otherwise), so a float32 file is never read as float16 or int8."""
    desc = fp.descriptor(checkpoint, "mlx", dtype, 0)
    desc += f";kernels={kernels};fused={bool(fused)};quantized={bool(quantized)}"
    desc += f";mlx={mlx_version}"
    if state_layout:
        desc += f";states={state_layout}"
    if kv_format:
        desc += f";kv={kv_format}"
    return "kv_" + hashlib.sha256(desc.encode()).hexdigest()[:16]


def default_disk_bytes(root: Path) -> int:
    root.mkdir(parents=True, exist_ok=True)
    return min(DEFAULT_DISK_BYTES, shutil.disk_usage(root).free // 2)


@dataclass
class _Indexed:
    tokens: np.ndarray
    nbytes: int
    used: float
    marks: list[int] | None = None  # checkpoint positions (None: a file without states)


class CorruptEntry(ValueError):
    pass


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = mx.view(a, mx.uint16)
    return np.asarray(a)


def _from_numpy(a: np.ndarray, dtype: str) -> mx.array:
    out = mx.array(a)
    return mx.view(out, mx.bfloat16) if dtype == "bfloat16" else out


def _map(path: Path) -> memoryview:
    with path.open("rb") as f:
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


def _dtype_name(a: mx.array) -> str:
    return str(a.dtype).removeprefix("mlx.core.")


class DiskTier:
    """Prefix cache entries on disk under one fingerprint; thread-safe index, one writer."""

    def __init__(
        self, root: Path, max_bytes: int, fingerprint: str, min_tokens: int = 4, kv_format: str = ""
    ) -> None:
        self.root = Path(root)
        # the KV format files hold (kv/format.py `KVFormat.name`; "": the compute dtype), in
        # every header beside the fingerprint that names it
        self.kv_format = kv_format
        self.dir = self.root / fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = fingerprint
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._lock = threading.Lock()
        self._index: dict[str, _Indexed] = {}
        self._queue: queue.Queue = queue.Queue()
        self._writer: threading.Thread | None = None
        self.reads = self.read_bytes = self.writes = self.write_bytes = self.corrupt = 0
        self._scan()

    # -- index ---------------------------------------------------------------------

    def _scan(self) -> None:
        for tmp in self.dir.glob("*.tmp"):
            tmp.unlink(missing_ok=True)  # a write cut short
        for path in sorted(self.dir.glob("*" + SUFFIX)):
            try:
                with path.open("rb") as f:
                    header, tokens = self._read_head(f)
                st = path.stat()
                if st.st_size != header["size"]:
                    raise CorruptEntry(f"{st.st_size} bytes, the header says {header['size']}")
            except (OSError, ValueError) as exc:
                self._skip(path, exc)
                continue
            marks = [int(m[0]) for m in header["marks"]] if "marks" in header else None
            self._index[path.stem] = _Indexed(tokens, st.st_size, st.st_mtime, marks)
        with self._lock:
            self._evict()

    def _read_head(self, f) -> tuple[dict, np.ndarray]:
        width = _TOKEN_BYTES.get(f.read(len(MAGIC)))
        if width is None:
            raise CorruptEntry("not a prefix cache file")
        (length,) = struct.unpack("<Q", f.read(8))
        if length > 1 << 20:
            raise CorruptEntry("header too long")
        header = json.loads(f.read(length))
        if header.get("fingerprint") != self.fingerprint:
            raise CorruptEntry("written by another model, dtype or kernel set")
        self._check_format(header)
        raw = f.read(width * int(header["tokens"]))
        if len(raw) != width * int(header["tokens"]):
            raise CorruptEntry("truncated")
        return header, np.frombuffer(raw, dtype=f"<i{width}")

    def _check_format(self, header: dict) -> None:
        if header.get("kv", "") != self.kv_format:
            held = header.get("kv") or "the compute dtype"
            raise CorruptEntry(f"KV held as {held}, not {self.kv_format or 'the compute dtype'}")

    def _skip(self, path: Path, exc: Exception) -> None:
        self.corrupt += 1
        log.warning("prefix cache file %s skipped and deleted (%s)", path, exc)
        path.unlink(missing_ok=True)

    def stats(self) -> dict[str, int]:
        with self._lock:
            held = sum(e.nbytes for e in self._index.values())
            entries = len(self._index)
        return {
            "disk_reads": self.reads,
            "disk_read_bytes": self.read_bytes,
            "disk_writes": self.writes,
            "disk_write_bytes": self.write_bytes,
            "disk_bytes": held,
            "disk_entries": entries,
            "disk_corrupt": self.corrupt,
        }

    # -- reads ---------------------------------------------------------------------

    def load_longest(self, query: np.ndarray, floor: int):
        """(tokens, keys, values, marks) of the file sharing the longest prefix with `query`, longer
        than `floor` and at least `min_tokens`; None when no valid file does."""
        with self._lock:
            found = []
            for key, entry in self._index.items():
                n = min(len(entry.tokens), len(query))
                if n <= max(floor, self.min_tokens - 1):
                    continue
                same = entry.tokens[:n] == query[:n]
                length = n if same.all() else int(np.argmin(same))
                if entry.marks is not None:  # a state resumes only from a checkpoint
                    length = max((p for p in entry.marks if p <= length), default=0)
                worth = length >= READ_TOKENS or 8 * length >= len(entry.tokens)
                if length > floor and length >= self.min_tokens and worth:
                    found.append((length, key))
        for _, key in sorted(found, reverse=True):
            loaded = self._load(key)
            if loaded is not None:
                return loaded
        return None

    def recent(self, n: int) -> list:
        """(tokens, keys, values, marks) of the `n` most recently used files of at least READ_TOKENS
        tokens, most recent first (a restarted server's last conversations), none a prefix of
        another's; corrupt files are skipped as on any read."""
        with self._lock:
            index = {k: e.tokens for k, e in self._index.items() if len(e.tokens) >= READ_TOKENS}
            used = {k: self._index[k].used for k in index}

        def covered(key: str) -> bool:  # an earlier turn's file that a longer file starts with
            t = index[key]
            return any(len(u) > len(t) and np.array_equal(u[: len(t)], t) for u in index.values())

        out = []
        for key in sorted(index, key=used.get, reverse=True):  # (files x the ones looked at)
            if len(out) == n:
                break
            if covered(key):
                continue
            loaded = self._load(key)
            if loaded is not None:
                out.append(loaded)
        return out

    def _load(self, key: str):
        path = self.dir / (key + SUFFIX)
        try:
            data = _map(path)  # the page cache's pages, not a copy of them
            width = _TOKEN_BYTES.get(bytes(data[: len(MAGIC)]))
            if width is None:
                raise CorruptEntry("not a prefix cache file")
            head_end = len(MAGIC) + 8 + struct.unpack_from("<Q", data, len(MAGIC))[0]
            header = json.loads(bytes(data[len(MAGIC) + 8 : head_end]))
            if header.get("fingerprint") != self.fingerprint or len(data) != header["size"]:
                raise CorruptEntry("truncated or from another fingerprint")
            self._check_format(header)
            body = data[head_end:]
            if zlib.crc32(body) != header["crc32"]:
                raise CorruptEntry("checksum mismatch")
            n = int(header["tokens"])
            tokens = np.frombuffer(body[: width * n], dtype=f"<i{width}").astype(np.int64)
            keys, values, at = [], [], width * n
            for shape_k, shape_v in header["layers"]:
                for shape, out in ((shape_k, keys), (shape_v, values)):
                    dt = np.dtype(_NP[header["dtype"]])
                    size = int(np.prod(shape)) * dt.itemsize
                    arr = np.frombuffer(body[at : at + size], dtype=dt).reshape(shape)
                    out.append(_from_numpy(arr, header["dtype"]))
                    at += size
            marks = {}  # position -> per recurrent layer its arrays (None: not written)
            for pos, layers in header.get("marks", ()):
                snap = []
                for arrays in layers:
                    got = []
                    for spec in arrays:
                        if spec is None:
                            got.append(None)
                            continue
                        shape, name = spec
                        dt = np.dtype(_NP[name])
                        size = int(np.prod(shape)) * dt.itemsize
                        arr = np.frombuffer(body[at : at + size], dtype=dt).reshape(shape)
                        got.append(_from_numpy(arr, name))
                        at += size
                    snap.append(tuple(got))
                marks[int(pos)] = tuple(snap)
        except FileNotFoundError:  # deleted by another server's bound on the same folder
            with self._lock:
                self._index.pop(key, None)
            return None
        except (OSError, ValueError, KeyError, struct.error) as exc:
            with self._lock:
                self._index.pop(key, None)
            self._skip(path, exc)
            return None
        with self._lock:
            if key in self._index:
                self._index[key].used = time.time()
        self.reads += 1
        self.read_bytes += len(data)
        return tokens, keys, values, marks

    # -- writes --------------------------------------------------------------------

    def put(
        self,
        tokens: np.ndarray,
        keys: list[mx.array],
        values: list[mx.array],
        marks: dict | None = None,
    ) -> None:
        """Queue an entry for writing (skipped when the same tokens are on disk already);
        `marks`: its state checkpoints (position -> per recurrent layer its arrays)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        key = hashlib.blake2b(tokens.tobytes(), digest_size=16).hexdigest()
        with self._lock:
            known = self._index.get(key)
            if known is not None and len(known.marks or ()) >= len(marks or ()):
                known.used = time.time()
                return
        dtype = _dtype_name(keys[0]) if keys else "float32"
        states = None
        if marks:
            states = [
                (
                    p,
                    [
                        [None if a is None else (_to_numpy(a), _dtype_name(a)) for a in arrays]
                        for arrays in snap
                    ],
                )
                for p, snap in sorted(marks.items())
            ]
        item = (
            key,
            tokens,
            [_to_numpy(k) for k in keys],
            [_to_numpy(v) for v in values],
            dtype,
            states,
        )
        if self._writer is None or not self._writer.is_alive():
            self._writer = threading.Thread(
                target=self._write_loop, name="prefix-disk", daemon=True
            )
            self._writer.start()
        self._queue.put(item)

    def close(self) -> None:
        """Finish the queued writes."""
        if self._writer is not None and self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    def flush(self) -> None:
        self._queue.join()

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._write(*item)
            except OSError as exc:
                log.warning("prefix cache: could not write to %s (%s)", self.dir, exc)
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, key, tokens, keys, values, dtype, states=None) -> None:
        parts = [tokens.astype("<i8").tobytes()]
        for k, v in zip(keys, values, strict=True):
            parts += [np.ascontiguousarray(k).tobytes(), np.ascontiguousarray(v).tobytes()]
        marks = []
        for pos, snap in states or ():
            specs = []
            for arrays in snap:
                specs.append([None if a is None else [list(a[0].shape), a[1]] for a in arrays])
                parts += [np.ascontiguousarray(a[0]).tobytes() for a in arrays if a is not None]
            marks.append([int(pos), specs])
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        header = {
            "fingerprint": self.fingerprint,
            "tokens": len(tokens),
            "dtype": dtype,
            "kv": self.kv_format,
            "layers": [[list(k.shape), list(v.shape)] for k, v in zip(keys, values, strict=True)],
            "crc32": crc,
            "size": 0,
        }
        if states is not None:
            header["marks"] = marks
        body = sum(len(p) for p in parts)
        head = json.dumps(header).encode()
        # the size field's digits change the header's length: settle it in two passes
        for _ in range(2):
            header["size"] = len(MAGIC) + 8 + len(head) + body
            head = json.dumps(header).encode()
        if header["size"] > self.max_bytes:
            return
        path = self.dir / (key + SUFFIX)
        tmp = path.with_suffix(".tmp")
        with tmp.open("wb") as f:
            f.write(MAGIC + struct.pack("<Q", len(head)) + head)
            for part in parts:
                f.write(part)
        os.replace(tmp, path)
        with self._lock:
            # entries this one extends (or holds, named from int32 ids by version 1)
            for other, entry in list(self._index.items()):
                n = len(entry.tokens)
                if n <= len(tokens) and np.array_equal(entry.tokens, tokens[:n]) and other != key:
                    self._remove(other)
            positions = [m[0] for m in marks] if states is not None else None
            self._index[key] = _Indexed(tokens.copy(), header["size"], time.time(), positions)
            self._evict()
        self.writes += 1
        self.write_bytes += header["size"]

    def _remove(self, key: str) -> None:
        self._index.pop(key, None)
        (self.dir / (key + SUFFIX)).unlink(missing_ok=True)

    def _evict(self) -> None:
        """Delete files until the folder (and other fingerprints' folders) fit the bound:
        other fingerprints' first, then the least recently used (lock held)."""
        held = sum(e.nbytes for e in self._index.values())
        stale = []  # (mtime, size, path) of other fingerprints' files
        for d in self.root.iterdir():
            if d.is_dir() and d != self.dir and d.name.startswith("kv_"):
                for p in d.glob("*" + SUFFIX):
                    with contextlib.suppress(FileNotFoundError):  # another server's bound
                        st = p.stat()
                        stale.append((st.st_mtime, st.st_size, p))
        stale.sort()
        total = held + sum(size for _, size, _ in stale)
        for _, size, p in stale:
            if total <= self.max_bytes:
                return
            total -= size
            p.unlink(missing_ok=True)
        for key in sorted(self._index, key=lambda k: self._index[k].used):
            if total <= self.max_bytes:
                return
            total -= self._index[key].nbytes
            self._remove(key)
