"""Embedding pooling: how a checkpoint turns final hidden states into one vector per input.

Read from sentence-transformers' files when the checkpoint has them (`modules.json`, the
Pooling module's `config.json`, a Normalize module, `config_sentence_transformers.json` prompts);
otherwise last-token pooling with L2 normalisation (how decoder embedders such as
Qwen3-Embedding are trained). Pooling runs chunk by chunk so a long input never holds all of its
hidden states, and only over each input's real positions (padding is never read).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

POOLING_MODULE = "sentence_transformers.models.Pooling"
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
TRANSFORMER_MODULES = (
    "sentence_transformers.models.Transformer",
    "sentence_transformers.models.transformer.Transformer",
)
# Pooling config keys -> our modes; any other mode set true is refused.
_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


class Pooling(enum.Enum):
    LAST = "last"  # the hidden state of each input's real last token
    MEAN = "mean"  # the mean over each input's real tokens
    CLS = "cls"  # the hidden state of the first token


@dataclass(frozen=True)
class EmbeddingConfig:
    """How the served model embeds."""

    pooling: Pooling
    normalize: bool  # L2-normalise each vector
    prompts: dict[str, str] = field(default_factory=dict)  # input_type -> text prefix
    size: int | None = None  # features per vector (the model's hidden size), when known
    source: str = "default"  # where the settings came from (logged, shown in errors)


class EmbeddingConfigError(ValueError):
    """The checkpoint's sentence-transformers files ask for something we cannot compute."""


def load_embedding_config(model_path: str | Path, pooling: str | None = None) -> EmbeddingConfig:
    """The checkpoint's pooling, normalisation and prompts; `pooling` overrides the mode.

    Raises EmbeddingConfigError for modules or pooling modes that cannot be served exactly
    (a Dense projection, max pooling, ...), so embeddings are refused rather than wrong.
    """
    path = Path(model_path)
    prompts = _prompts(path)
    size = _hidden_size(path)
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        mode = Pooling(pooling) if pooling else Pooling.LAST
        return EmbeddingConfig(mode, True, prompts, size, source="default")
    modules = json.loads(modules_file.read_text())
    mode: Pooling | None = None
    normalize = False
    for module in modules:
        kind = module.get("type", "")
        if kind in TRANSFORMER_MODULES:
            continue
        if kind == POOLING_MODULE:
            mode = _pooling_mode(path / module.get("path", ""))
        elif kind == NORMALIZE_MODULE:
            normalize = True
        else:
            raise EmbeddingConfigError(
                f"modules.json lists {kind!r} ({module.get('path')}); only Transformer, "
                "Pooling and Normalize modules can be served"
            )
    if pooling:
        mode = Pooling(pooling)
    if mode is None:
        raise EmbeddingConfigError("modules.json has no Pooling module; pass --pooling")
    return EmbeddingConfig(mode, normalize, prompts, size, source="sentence-transformers")


def _hidden_size(path: Path) -> int | None:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        return None
    size = json.loads(cfg_file.read_text()).get("hidden_size")
    return size if isinstance(size, int) else None


def _pooling_mode(folder: Path) -> Pooling:
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise EmbeddingConfigError(f"{cfg_file} is missing")
    cfg = json.loads(cfg_file.read_text())
    chosen = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    unknown = [k for k in chosen if k not in _MODES]
    if unknown or len(chosen) != 1:
        raise EmbeddingConfigError(
            f"{cfg_file} sets {chosen or 'no pooling mode'}; exactly one of "
            f"{', '.join(_MODES)} can be served"
        )
    if cfg.get("include_prompt", True) is False:
        raise EmbeddingConfigError(f"{cfg_file} sets include_prompt false, which is not served")
    return Pooling(_MODES[chosen[0]])


def _prompts(path: Path) -> dict[str, str]:
    cfg_file = path / "config_sentence_transformers.json"
    if not cfg_file.is_file():
        return {}
    prompts = json.loads(cfg_file.read_text()).get("prompts") or {}
    return {str(k): str(v) for k, v in prompts.items() if isinstance(v, str)}


class PoolAccumulator:
    """Pools a padded batch chunk by chunk: feed [N, q, hidden] chunks in order, then finish.

    `lengths` are the real lengths of the N rows; positions at or past a row's length are
    padding and never read.
    """

    def __init__(self, pooling: Pooling, lengths: list[int]) -> None:
        self.pooling = pooling
        self.lengths = np.asarray(lengths, dtype=np.int64)  # [N]
        self.out: np.ndarray | None = None  # [N, hidden] float64, made on the first chunk
        self.offset = 0  # positions fed so far

    def add(self, hidden: np.ndarray) -> None:
        """Fold hidden states [N, q, hidden] of positions offset..offset+q into the pool."""
        n, q, size = hidden.shape
        if n != len(self.lengths):
            raise ValueError(f"a chunk of {n} rows for a batch of {len(self.lengths)}")
        if self.out is None:
            self.out = np.zeros((n, size), dtype=np.float64)
        lo, hi = self.offset, self.offset + q
        for r in range(n):
            length = int(self.lengths[r])
            if self.pooling is Pooling.MEAN:
                end = min(length, hi) - lo
                if end > 0:
                    self.out[r] += hidden[r, :end].sum(axis=0, dtype=np.float64)
            elif self.pooling is Pooling.LAST:
                if lo <= length - 1 < hi:
                    self.out[r] = hidden[r, length - 1 - lo]
            elif lo == 0:  # CLS: the first position
                self.out[r] = hidden[r, 0]
        self.offset = hi

    def finish(self, normalize: bool) -> np.ndarray:
        """The pooled vectors [N, hidden] float32 (L2-normalised when asked)."""
        if self.out is None:
            raise ValueError("no hidden states were pooled")
        out = self.out
        if self.pooling is Pooling.MEAN:
            out = out / self.lengths[:, None]
        if normalize:
            out = l2_normalize(out)
        return out.astype(np.float32)


def l2_normalize(x: np.ndarray) -> np.ndarray:
    """Rows of `x` scaled to unit L2 norm (a zero row stays zero)."""
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return x / np.where(norm == 0, 1, norm)


def truncate(vector: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first `dimensions` features, re-normalised (Matryoshka embeddings); None: as is."""
    if dimensions is None:
        return vector
    return l2_normalize(vector[:dimensions].astype(np.float64)).astype(np.float32)
