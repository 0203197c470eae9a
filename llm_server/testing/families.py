"""Tiny random checkpoints of every architecture family the server is tested on.

Each is built with mlx-lm's own model class (its own initialisation, seeded), saved with
mlx-lm's own writer, and carries the tiny BPE tokenizer of `tiny.py`: a folder the engine and
`mlx_lm.load` both load. Dimensions are tiny (hidden 64, 2-4 layers) and sliding windows are 8
positions, so a ~20-token prompt already reaches past them.
"""

from __future__ import annotations

import json
from pathlib import Path

from llm_server.testing.tiny import build_tokenizer, write_tokenizer_files

WINDOW = 8  # sliding window of the families that have one
_POST_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")
_OUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "out_proj.weight", "w2.weight")
_BASE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}

# model_type -> config entries on top of _BASE
FAMILIES: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {**_MOE, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
    "gemma2": {"query_pre_attn_scalar": 16, "num_hidden_layers": 2},
    "gemma3_text": {
        "query_pre_attn_scalar": 16,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,  # layers 0, 2 sliding; 1, 3 global
        "num_hidden_layers": 4,
    },
    "mistral": {
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "phi3": {},
    "gpt_oss": {
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 64,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "smollm3": {"no_rope_layer_interval": 2},  # layer 1 has no rotary embedding
    "olmo2": {},
    "granite": {
        "logits_scaling": 0.5,
        "attention_multiplier": 0.25,
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
    },
    "lfm2": {
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "num_hidden_layers": 4,
        "tie_word_embeddings": True,
    },
    "qwen3_next": {
        **_MOE,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "partial_rotary_factor": 0.5,
        "full_attention_interval": 2,  # layer 0 linear attention, layer 1 full
        "norm_topk_prob": True,
    },
    "nemotron_h": {
        "hybrid_override_pattern": ["M", "*", "-", "M"],
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "mamba_proj_bias": False,
        "ssm_state_size": 16,
        "conv_kernel": 4,
        "n_groups": 2,
        "layer_norm_epsilon": 1e-5,
        "use_bias": False,
        "use_conv_bias": True,
        "time_step_limit": [0.0, 1e9],
    },
    # gated delta + attention (Qwen3.5/3.6): layers 0-2 linear attention, layer 3 full
    "qwen3_5": {
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "num_hidden_layers": 4,
        "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    },
    "qwen3_5_moe": {
        **_MOE,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 2,
        "shared_expert_intermediate_size": 64,
        "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    },
    # mamba2 + attention (Granite 4)
    "granitemoehybrid": {
        "logits_scaling": 1.0,
        "attention_multiplier": 0.25,
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "layer_types": ["mamba", "attention", "mamba", "mamba"],
        "num_hidden_layers": 4,
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_proj_bias": False,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_conv_bias": True,
        "mamba_expand": 1,  # (transformers checks heads x head dim == expand x hidden)
        "shared_intermediate_size": 128,
        "position_embedding_type": "rope",
        "time_step_limit": [0.0, 1e9],
        "tie_word_embeddings": False,
    },
    # mamba and attention side by side in every layer (a CacheList per layer)
    "falcon_h1": {
        # mlx-lm folds these into the weights at load (as for an HF checkpoint): 1 keeps the
        # random init's scale
        **dict.fromkeys(
            ["lm_head_multiplier", "embedding_multiplier", "attention_in_multiplier"]
            + ["attention_out_multiplier", "key_multiplier", "ssm_in_multiplier"]
            + ["ssm_out_multiplier"],
            1.0,
        ),
        "mlp_multipliers": [1.0, 1.0],
        "ssm_multipliers": [1.0] * 5,
        "mamba_d_conv": 4,
        "mamba_d_head": 16,
        "mamba_d_ssm": 64,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_n_heads": 4,
        "mamba_chunk_size": 16,
        "tie_word_embeddings": False,
    },
    # chunked attention (ChunkedKVCache, chunks of 8) on 3 of 4 layers, MoE every 2nd layer;
    # the text model nests under text_config
    "llama4": {
        "attention_chunk_size": WINDOW,
        "interleave_moe_layer_step": 2,
        "intermediate_size": 64,
        "intermediate_size_mlp": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 1,
        "num_hidden_layers": 4,
        "use_qk_norm": True,
        "rope_scaling": None,
    },
}
# not in engines/mlx/selfcheck.py VERIFIED_FAMILIES: the engine checks it at load
UNVERIFIED = {
    "cohere2": {
        "layer_norm_eps": 1e-5,
        "logit_scale": 0.5,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "num_hidden_layers": 4,
    },
}
FAMILIES.update(UNVERIFIED)
_NESTED = {"llama4": "llama4_text"}  # model_type -> its text_config's model_type


def family_config(model_type: str, vocab_size: int, eos_id: int, bos_id: int) -> dict:
    body = {**_BASE, **FAMILIES[model_type], "vocab_size": vocab_size}
    ids = {"eos_token_id": eos_id, "bos_token_id": bos_id}
    if model_type in _NESTED:
        return {
            "model_type": model_type,
            "text_config": {**body, **ids, "model_type": _NESTED[model_type]},
            **ids,
        }
    return {"model_type": model_type, **body, **ids}


def build_family_checkpoint(
    out_dir: str | Path, model_type: str, seed: int = 0, sizes: dict | None = None
) -> Path:
    """Write a tiny random `model_type` checkpoint (mlx-lm layout) to `out_dir`; its path
    (`sizes`: top-level config entries replacing the tiny ones, for a larger random model)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map, tree_unflatten
    from mlx_lm.utils import _get_classes, save_config, save_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(384)
    eos_id, bos_id = write_tokenizer_files(out, tok, 1024)
    config = {**family_config(model_type, tok.get_vocab_size(), eos_id, bos_id), **(sizes or {})}
    model_cls, args_cls = _get_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    # wider logit margins than the default init gives (no near-ties for greedy decoding)
    params = dict(tree_flatten(model.parameters()))
    head = "lm_head.weight" if "lm_head.weight" in params else None
    model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    if head is not None:
        model.lm_head.weight = model.lm_head.weight * 8.0
    else:  # tied: let the layers outweigh the input embedding (else greedy repeats it)
        scaled = {
            k: v * 6.0 for k, v in params.items() if k.endswith(_OUT_PROJECTIONS) and v.ndim >= 2
        }
        # gemma's post-attention/-feedforward norms (1 + weight, weight 0 at init) cap each
        # layer's output: raise them the same way
        scaled.update(
            {k: v + 5.0 for k, v in params.items() if k.endswith(_POST_NORMS) and v.ndim == 1}
        )
        model.update(tree_unflatten(list(scaled.items())))
    mx.eval(model.parameters())
    save_model(out, model)
    save_config(config, out / "config.json")
    json.loads((out / "config.json").read_text())  # written whole
    return out
