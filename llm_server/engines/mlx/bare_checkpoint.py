"""Checkpoints saved from the bare transformer, as embedding models often are.

sentence-transformers (and `AutoModel.save_pretrained`) save the decoder without its causal-LM
wrapper: keys lack the `model.` prefix (`layers.0.self_attn.q_proj.weight`) and there may be no
`lm_head`. mlx-lm expects the causal-LM layout, so `model_classes` (for mlx-lm's
`load_model(get_model_classes=...)`) wraps its model class with a sanitize step that adds the
prefix, and, when an untied head is missing, stands the input embeddings in for it and marks
the model `has_lm_head = False` (the server then serves embeddings only).
"""

from __future__ import annotations

PREFIX = "model."
BARE_NAMES = ("embed_tokens.", "layers.")  # the decoder stack's own top-level weights


def add_model_prefix(weights: dict) -> dict:
    """Keys of a bare-transformer checkpoint in the causal-LM layout; others unchanged.

    Bare means: the decoder's own top-level names (`embed_tokens.`, `layers.`) and nothing
    under `model.`; checkpoints of other layouts (`backbone.`, `language_model.`) pass as they are.
    """
    if not any(k.startswith(BARE_NAMES) for k in weights):
        return weights
    if any(k.startswith(PREFIX) for k in weights):
        return weights
    return {k if k.startswith("lm_head.") else PREFIX + k: v for k, v in weights.items()}


def model_classes(config: dict):
    """mlx-lm's (model class, args class) for `config`, the model class reading bare layouts."""
    from mlx_lm.utils import _get_classes  # load_model's own default for get_model_classes

    from llm_server.engines.mlx.vlm_checkpoint import is_vlm, vlm_text_classes

    if is_vlm(config):  # a vision-language checkpoint: its language model alone
        return vlm_text_classes(config)
    model_cls, args_cls = _get_classes(config)
    return _bare_aware(model_cls), args_cls


def _bare_aware(model_cls: type) -> type:
    class Model(model_cls):
        has_lm_head = True

        def sanitize(self, weights: dict) -> dict:
            if "model" in self:  # the mlx-lm class keeps its decoder stack under `model`
                weights = add_model_prefix(weights)
            if hasattr(super(), "sanitize"):
                weights = super().sanitize(weights)
            head_needed = "lm_head" in self and "lm_head.weight" not in weights
            embed = weights.get(PREFIX + "embed_tokens.weight")
            if head_needed and embed is not None and "model.embed_tokens.scales" not in weights:
                weights["lm_head.weight"] = embed  # a stand-in: generation is refused
                self.has_lm_head = False
            return weights

    Model.__name__ = Model.__qualname__ = model_cls.__name__
    Model.__module__ = model_cls.__module__
    return Model
