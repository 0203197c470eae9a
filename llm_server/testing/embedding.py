"""Lay sentence-transformers embedding files over a checkpoint folder (tests, benchmarks).

Writes `modules.json`, `1_Pooling/config.json`, `2_Normalize/` (when normalising) and
`config_sentence_transformers.json` with query/document prompts, as sentence-transformers saves
them for a decoder embedder such as Qwen3-Embedding.
"""

from __future__ import annotations

import json
from pathlib import Path

_MODE_KEYS = {
    "last": "pooling_mode_lasttoken",
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
}


def add_sentence_transformers_files(
    path: str | Path,
    pooling: str = "last",
    normalize: bool = True,
    prompts: dict[str, str] | None = None,
) -> Path:
    """Add the pooling files to the checkpoint at `path` (its config.json gives the width)."""
    if pooling not in _MODE_KEYS:
        raise ValueError(f"pooling must be one of {sorted(_MODE_KEYS)}, got {pooling!r}")
    out = Path(path)
    hidden = json.loads((out / "config.json").read_text())["hidden_size"]
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
        (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    pool = {"word_embedding_dimension": hidden, "include_prompt": True}
    pool |= {key: mode == pooling for mode, key in _MODE_KEYS.items()}
    pool |= {
        "pooling_mode_max_tokens": False,
        "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False,
    }
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pool, indent=2))
    st_config = {
        "prompts": prompts or {},
        "default_prompt_name": None,
        "similarity_fn_name": "cosine",
    }
    (out / "config_sentence_transformers.json").write_text(json.dumps(st_config, indent=2))
    return out
