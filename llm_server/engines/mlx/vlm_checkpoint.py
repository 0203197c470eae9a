"""Vision-language checkpoints whose language model runs in this engine as its text family.

A VLM folder (mlx-vlm's layout, as mlx-community uploads and `mlx_vlm.convert` write it, or the
original Hugging Face one) holds a vision tower, a projector and a language model. The engine
loads only the language model, as the mlx-lm text family it is (`TEXT_FAMILIES`), from
`text_config` and the language model's weights renamed to the causal-LM layout; the tower and
projector are the vision renderer's (`llm_server/vision/`, through mlx-vlm). A text-only
request to a VLM therefore runs exactly as on its language model alone.
"""

from __future__ import annotations

# VLM model_type -> the mlx-lm text family of its language model (1-D positions only: the
# Qwen-VL families' M-RoPE stays with mlx-lm's own qwen2_vl / qwen3_vl classes, text only)
TEXT_FAMILIES: dict[str, str | None] = {
    "gemma3": "gemma3_text",
    "idefics3": "llama",
    "smolvlm": "llama",
    "lfm2_vl": "lfm2",
    "lfm2-vl": "lfm2",
    "mistral3": None,  # None: text_config's own model_type (mistral, ministral3)
}
# what a family's language model takes when its text_config omits it: mlx-vlm's defaults (real
# Gemma 3 configs leave the heads and vocabulary to them), transformers' for the context length
TEXT_DEFAULTS = {
    "gemma3": {
        "vocab_size": 262208,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 131072,
    },
}
# families whose output layer is always the input embeddings (as mlx-vlm loads them)
TIED = frozenset({"gemma3", "lfm2_vl", "lfm2-vl"})
# checkpoint prefix -> causal-LM prefix, first match wins; any other weight is not the LM's
_RENAMES = (
    ("language_model.model.", "model."),  # mlx-vlm / HF (gemma3, lfm2_vl)
    ("language_model.lm_head.", "lm_head."),
    ("language_model.", "model."),  # mlx-vlm's flat language models (idefics3)
    ("model.language_model.", "model."),  # transformers >= 4.52
    ("model.text_model.", "model."),  # HF idefics3 / smolvlm
    ("lm_head.", "lm_head."),
)


def is_vlm(config: dict) -> bool:
    """Whether `config` is a vision-language family whose language model the engine runs."""
    return config.get("model_type") in TEXT_FAMILIES and "text_config" in config


def text_config(config: dict) -> dict:
    """The language model's config as its text family's (top-level ids and sizes filled in)."""
    text = dict(config["text_config"])
    text["model_type"] = TEXT_FAMILIES[config["model_type"]] or text["model_type"]
    for key in ("vocab_size", "eos_token_id", "bos_token_id", "quantization"):
        if key not in text and key in config:
            text[key] = config[key]
    return {**TEXT_DEFAULTS.get(config["model_type"], {}), **text}


def language_weights(weights: dict, tied: bool = False) -> dict:
    """The language model's weights under the causal-LM names; the tower's and projector's
    dropped (and the output layer's, `tied`: the embeddings stand in for it)."""
    out = {}
    for key, value in weights.items():
        for old, new in _RENAMES:
            if key.startswith(old):
                out[new + key[len(old) :]] = value
                break
    if tied:
        out = {k: v for k, v in out.items() if not k.startswith("lm_head.")}
    return out


def vlm_text_classes(config: dict):
    """mlx-lm's (model class, args class) of a VLM's language model: the args read
    `text_config`, the model's sanitize keeps and renames the language model's weights."""
    from mlx_lm.utils import _get_classes

    text = text_config(config)
    tied = config["model_type"] in TIED
    model_cls, args_cls = _get_classes(text)

    class Args(args_cls):
        @classmethod
        def from_dict(cls, params: dict):
            return args_cls.from_dict(text_config(params) if is_vlm(params) else params)

    class Model(model_cls):
        def sanitize(self, weights: dict) -> dict:
            weights = language_weights(weights, tied)
            return super().sanitize(weights) if hasattr(super(), "sanitize") else weights

    Model.__name__ = Model.__qualname__ = model_cls.__name__
    Model.__module__ = model_cls.__module__
    return Model, Args
