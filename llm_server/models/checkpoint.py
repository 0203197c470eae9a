"""A checkpoint's files checked before a load (headers only, no weights read): a corrupt,
truncated or mismatched file is named, with what is wrong with it, before any model is evicted
to make room for it."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

# bytes per element of each safetensors dtype
DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U64": 8, "I32": 4, "U32": 4,
    "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}  # fmt: skip
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on the JSON header
_LFS = b"version https://git-lfs"
_LAYER = re.compile(r"^(.*?\blayers)\.(\d+)\.")
# config.json fields a tensor's dims come from (named in a shape mismatch's message)
_DIMS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


class CheckpointError(ValueError):
    """A checkpoint file is unusable; the message names the file and what is wrong with it."""


def read_header(shard: Path) -> dict:
    """The JSON header of the safetensors file `shard` (tensor name -> dtype, shape,
    data_offsets), checked against the file's size; CheckpointError says what is wrong."""
    size = shard.stat().st_size
    with shard.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(
                f"{shard} is not a safetensors file: {size} bytes, too short for its 8-byte "
                "header length (an empty or cut-short download: fetch it again)"
            )
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, MAX_HEADER_BYTES):
            hint = " (a Git LFS pointer, not the weights: run `git lfs pull`)"
            raise CheckpointError(
                f"{shard} is not a safetensors file: its first 8 bytes give a header of "
                f"{length} bytes but the file has {size} bytes" + (hint if head == _LFS[:8] else "")
            )
        raw = f.read(length)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(
            f"{shard} has no safetensors header: its {length} header bytes are not JSON ({exc})"
        ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{shard} has no safetensors header: it is not a JSON object")
    end = max((_check_tensor(shard, name, info) for name, info in _tensors(header)), default=0)
    if 8 + length + end > size:
        raise CheckpointError(
            f"{shard} is truncated: {size} bytes, but its header places tensors up to byte "
            f"{8 + length + end} (an incomplete download: fetch it again)"
        )
    return header


def _tensors(header: dict):
    return ((k, v) for k, v in header.items() if k != "__metadata__")


def _check_tensor(shard: Path, name: str, info: object) -> int:
    """Where tensor `name`'s data ends (bytes after the header); CheckpointError if its entry
    is malformed."""
    try:
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        numel = 1
        for dim in shape:
            if not isinstance(dim, int) or dim < 0:
                raise ValueError(dim)
            numel *= dim
        if dtype not in DTYPE_BYTES or not 0 <= begin <= end:
            raise ValueError(dtype)
    except (TypeError, KeyError, ValueError):
        raise CheckpointError(
            f"{shard}: the header's entry for tensor {name!r} is malformed ({info!r:.200})"
        ) from None
    if end - begin != numel * DTYPE_BYTES[dtype]:
        raise CheckpointError(
            f"{shard}: tensor {name!r} of shape {shape} ({dtype}) needs "
            f"{numel * DTYPE_BYTES[dtype]} bytes but the header gives it {end - begin}"
        )
    return end


def check_checkpoint(path: Path) -> None:
    """Check the safetensors checkpoint folder `path` (other formats pass): config.json is a
    JSON object, every weights file's header is whole and fits its file, and the tensors'
    shapes are those config.json's architecture makes. CheckpointError names the file."""
    path = Path(path)
    config_file = path / "config.json"
    shards = sorted(path.glob("*.safetensors"))
    if not path.is_dir() or not config_file.is_file() or not shards:
        return  # .gguf, .mlpackage, a bare folder: the loader says what is missing
    try:
        config = json.loads(config_file.read_text())
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{config_file} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} is not a JSON object")
    headers = {shard: read_header(shard) for shard in shards}
    expected = _expected_shapes(config)
    if expected is not None:
        _check_shapes(config_file, config, headers, expected)


def _expected_shapes(config: dict) -> dict[str, tuple[int, ...]] | None:
    """Parameter name -> shape of mlx-lm's model for `config` (built lazily: nothing is
    allocated); None when mlx-lm cannot build it (the load then says why)."""
    try:
        from mlx.utils import tree_flatten

        from llm_server.engines.mlx.bare_checkpoint import model_classes

        model_cls, args_cls = model_classes(config)
        model = model_cls(args_cls.from_dict(config))
        return {name: tuple(v.shape) for name, v in tree_flatten(model.parameters())}
    except Exception:  # noqa: BLE001 - any failure here is the load's to report
        return None


def _check_shapes(
    config_file: Path,
    config: dict,
    headers: dict[Path, dict],
    expected: dict[str, tuple[int, ...]],
) -> None:
    """CheckpointError when a float tensor's shape is not the model's (up to the transposes
    mlx-lm's sanitize makes), or the weights hold fewer layers than config.json asks for."""
    text = {**config, **(config.get("text_config") or {})}
    names = {name for header in headers.values() for name, _ in _tensors(header)}
    for shard, header in headers.items():
        for name, info in _tensors(header):
            want = expected.get(name, expected.get("model." + name))
            quantized = name.rsplit(".", 1)[0] + ".scales" in names
            if want is None or quantized or not info["dtype"].startswith(("F", "BF")):
                continue
            if sorted(info["shape"]) != sorted(want):
                dims = ", ".join(
                    f"{k} {text[k]}"
                    for k in _DIMS
                    if isinstance(text.get(k), int) and text[k] in want
                )
                raise CheckpointError(
                    f"{shard}: tensor {name!r} has shape {list(info['shape'])} but "
                    f"{config_file.name} ({text.get('model_type')}"
                    + (f": {dims}" if dims else "")
                    + f") makes it {list(want)}: the weights and config.json come from "
                    "different models"
                )
    held = _layers(names)
    for prefix, wanted in _layers(expected).items():
        have = held.get(prefix) or held.get(prefix.removeprefix("model."))
        if have and wanted - have:
            raise CheckpointError(
                f"the weights ({', '.join(s.name for s in headers)}) hold {len(have)} layers "
                f"under {prefix!r} but {config_file.name} asks for {len(wanted)} "
                f"(num_hidden_layers {text.get('num_hidden_layers')}): a weights file is "
                "missing, or config.json comes from another model"
            )


def _layers(names) -> dict[str, set[int]]:
    """Layer indices by the prefix they sit under (`model.layers` -> {0, 1, ...})."""
    out: dict[str, set[int]] = {}
    for name in names:
        match = _LAYER.match(name)
        if match:
            out.setdefault(match[1], set()).add(int(match[2]))
    return out
