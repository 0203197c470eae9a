"""The `llm_manifest.json` that describes an exported graph's interface, and the batching probe.

`supports_batching(path)` reads the manifest (MLX export) or the Core ML package spec (protobuf
only, no compile/load, so it works on Linux) and never touches weights.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

MANIFEST_NAME = "llm_manifest.json"
CONVERTER_VERSION = "1"
# The graph's query length covers decode (1) and the scoring chunk sizes (docs/ARCHITECTURE.md C4).
DEFAULT_Q_SIZES = (1, 16, 32, 64, 128)
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)
_CHUNK_BYTES = 1 << 22


class ConvertError(ValueError):
    """A checkpoint or option the converter cannot handle; the message says what to change."""


@dataclass(frozen=True)
class InputSpec:
    """One graph input; symbolic dims are named ("rows" is fixed, "q" varies per call)."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str  # "int32" | "float16" | "float32"


@dataclass(frozen=True)
class Manifest:
    """Interface of an exported graph, written as `llm_manifest.json` (and Core ML metadata)."""

    backend: str  # "mlx" | "coreml"
    model_type: str  # "llama" | "qwen2" | "qwen3"
    rows: int  # batch dimension of the graph
    context_length: int  # positions per row
    dtype: str  # weight/activation dtype of the export
    vocab_size: int
    q_sizes: tuple[int, ...]  # query lengths a call may feed
    inputs: tuple[InputSpec, ...]
    source_sha256: str  # hash of the source weight files (or the .gguf)
    quantization_bits: int | None = None
    converter_version: str = CONVERTER_VERSION
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        raw = json.loads(text)
        raw["inputs"] = tuple(
            InputSpec(i["name"], tuple(i["shape"]), i["dtype"]) for i in raw["inputs"]
        )
        raw["q_sizes"] = tuple(raw["q_sizes"])
        return cls(**raw)

    @property
    def has_attn_mask(self) -> bool:
        return any(i.name == "attn_mask" for i in self.inputs)


def graph_inputs(rows: int, context_length: int, mask_dtype: str) -> tuple[InputSpec, ...]:
    """The batched interface both exporters share: ids, additive mask and positions."""
    return (
        InputSpec("input_ids", (rows, "q"), "int32"),
        InputSpec("attn_mask", (rows, 1, "q", context_length), mask_dtype),
        InputSpec("position_ids", (rows, "q"), "int32"),
    )


def write_manifest(folder: str | Path, manifest: Manifest) -> Path:
    path = Path(folder) / MANIFEST_NAME
    path.write_text(manifest.to_json())
    return path


def read_manifest(folder: str | Path) -> Manifest | None:
    """The folder's manifest, or None when it has none (a plain HF/MLX folder)."""
    path = Path(folder) / MANIFEST_NAME
    return Manifest.from_json(path.read_text()) if path.is_file() else None


def read_hf_config(folder: str | Path) -> dict:
    """`config.json` of an HF folder, checked for an architecture the exporters handle."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ConvertError(f"{folder}: no config.json (expected an HF checkpoint folder)")
    config = json.loads(path.read_text())
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConvertError(
            f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return config


def source_sha256(paths: list[Path]) -> str:
    """sha256 over the given files in name order (weights of the source checkpoint)."""
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.name):
        digest.update(path.name.encode())
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class GraphInfo:
    """What the batching probe learned; rows/context are None for a dynamic (MLX) graph."""

    rows: int | None
    context_length: int | None
    has_attn_mask: bool

    @property
    def supports_batching(self) -> bool:
        return self.has_attn_mask and (self.rows is None or self.rows > 1)


def graph_info(model_path: str | Path) -> GraphInfo:
    """Inspect a model folder, an `.mlpackage`, or a folder holding one, without loading it.

    A plain HF/MLX folder without a manifest is served by the MLX engine, which builds masks for
    any batch size at run time, so it reports a dynamic graph (rows None) with a mask.
    """
    path = Path(model_path)
    if path.suffix == ".mlpackage":
        return _package_info(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a model folder or .mlpackage")
    packages = sorted(path.glob("*.mlpackage"))
    if packages:
        return _package_info(packages[0])
    manifest = read_manifest(path)
    if manifest is not None:
        return GraphInfo(manifest.rows, manifest.context_length, manifest.has_attn_mask)
    if (path / "config.json").is_file():
        return GraphInfo(rows=None, context_length=None, has_attn_mask=True)
    raise FileNotFoundError(f"{path}: no config.json, {MANIFEST_NAME} or .mlpackage")


def supports_batching(model_path: str | Path) -> bool:
    """True exactly when the graph has an `attn_mask` input and a batch dimension above 1."""
    return graph_info(model_path).supports_batching


def package_spec_path(package: Path) -> Path:
    """The root `model.mlmodel` protobuf of an `.mlpackage`, found through its Manifest.json."""
    index = json.loads((package / "Manifest.json").read_text())
    entry = index["itemInfoEntries"][index["rootModelIdentifier"]]
    return package / "Data" / entry["path"]


def read_package_spec(package: str | Path):
    """Parse an `.mlpackage`'s model protobuf (coremltools.proto only; nothing is compiled)."""
    from coremltools.proto import Model_pb2

    spec = Model_pb2.Model()
    spec.ParseFromString(package_spec_path(Path(package)).read_bytes())
    return spec


def _package_info(package: Path) -> GraphInfo:
    spec = read_package_spec(package)
    inputs = {i.name: i for i in spec.description.input}
    ids = inputs.get("input_ids")
    rows = int(ids.type.multiArrayType.shape[0]) if ids is not None else None
    mask = inputs.get("attn_mask")
    context = int(mask.type.multiArrayType.shape[-1]) if mask is not None else None
    # A graph without an input_ids batch dimension cannot batch; report it as one row.
    return GraphInfo(rows=rows or 1, context_length=context, has_attn_mask=mask is not None)
