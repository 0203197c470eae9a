"""The checkpoint's `generation_config.json`: the sampling settings a request gets when it omits
them (as mlx-lm and vLLM apply them). Its `eos_token_id` list is read by the tokenizer module."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, fields
from pathlib import Path

log = logging.getLogger(__name__)

FILE = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    """Per-field defaults for requests; the class defaults are OpenAI's."""

    temperature: float = 1.0  # 0..2
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off


# field -> accepted range; a new field is one field above and one entry here
_RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 2.0),
    "top_p": (1e-9, 1.0),
    "top_k": (0, 1 << 30),
    "min_p": (0.0, 1.0),
}


def load_sampling_defaults(model_path: str | Path) -> SamplingDefaults:
    """The defaults `model_path/generation_config.json` sets; OpenAI's where it sets none.

    HF's `do_sample` is not consulted (vLLM does the same): a checkpoint that sets a temperature
    means it for sampling, and a request asking for temperature 0 is greedy either way. Values
    out of range are ignored with a warning rather than refusing to serve.
    """
    path = Path(model_path) / FILE
    if not path.is_file():
        return SamplingDefaults()
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("ignoring %s: %s", path, exc)
        return SamplingDefaults()
    if not isinstance(config, dict):
        return SamplingDefaults()
    chosen = {}
    for f in fields(SamplingDefaults):
        value = config.get(f.name)
        if value is None:
            continue
        lo, hi = _RANGES[f.name]
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if not ok or not math.isfinite(value) or not lo <= value <= hi:
            log.warning("ignoring %s=%r in %s (outside %g..%g)", f.name, value, path, lo, hi)
            continue
        chosen[f.name] = type(f.default)(value)
    if chosen:
        log.info("request defaults from %s: %s", FILE, chosen)
    return SamplingDefaults(**chosen)
