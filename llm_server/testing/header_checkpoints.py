"""Header-only checkpoints of models people run on Macs: config.json as published and
safetensors files whose headers list every tensor (names, shapes, dtypes) as an MLX 4-bit
conversion of the model stores them, with no weights: each file is sparse, its size the real
one (the estimate, the checkpoint check and the admission table read only headers and sizes).

The tensors are those of mlx-lm's model for the config, quantized as `mlx_lm.convert -q`
does (4 bits, groups of 64; built lazily: nothing is allocated or computed). The configs are
the models' public config.json fields that decide sizes (layers, widths, heads, experts,
vocabulary, context); a few fields of Qwen3.5-9B are written from memory of its card and may
differ slightly from the published file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

SHARD_BYTES = 5 << 30  # mlx_lm.convert's shard size
QUANTIZATION = {"group_size": 64, "bits": 4}

CONFIGS: dict[str, dict] = {
    "Llama-3.2-3B-Instruct-4bit": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-05,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
    "Qwen3-8B-4bit": {
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "Qwen3.5-9B-4bit": {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": {
            "model_type": "qwen3_5_text",
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 32,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "linear_num_value_heads": 32,
            "linear_num_key_heads": 16,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4,
            "vocab_size": 248320,
            "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-06,
            "tie_word_embeddings": False,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000000,
                "partial_rotary_factor": 0.25,
                "mrope_section": [11, 11, 10],
            },
            "torch_dtype": "bfloat16",
        },
        "tie_word_embeddings": False,
    },
    "gemma-3-12b-it-4bit (text)": {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16",
    },
    "gpt-oss-20b-4bit": {
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": 24,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "vocab_size": 201088,
        "max_position_embeddings": 131072,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "rms_norm_eps": 1e-05,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        "swiglu_limit": 7.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "Qwen3-Coder-30B-A3B-Instruct-4bit": {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "vocab_size": 151936,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000000,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}

_DTYPES = {"uint32": ("U32", 4), "float32": ("BF16", 2), "bfloat16": ("BF16", 2)}


def tensors(config: dict) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape) of every tensor a 4-bit MLX conversion stores."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import quantize_model

    from llm_server.engines.mlx.bare_checkpoint import model_classes

    model_cls, args_cls = model_classes(config)
    model = model_cls(args_cls.from_dict(config))  # lazy: no weight is allocated
    model, _ = quantize_model(model, dict(config), QUANTIZATION["group_size"], QUANTIZATION["bits"])
    out = {}
    for name, array in tree_flatten(model.parameters()):
        kind = "uint32" if array.dtype == mx.uint32 else "bfloat16"
        out[name] = (_DTYPES[kind][0], list(array.shape))
    return out


def build(root: Path, name: str) -> Path:
    """The header-only checkpoint `name` (a CONFIGS key) under `root`; built once."""
    folder = root / name.split(" ")[0]
    if (folder / "config.json").is_file():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = {**CONFIGS[name], "quantization": dict(QUANTIZATION)}
    listed = tensors(config)
    shards: list[dict[str, tuple[str, list[int]]]] = [{}]
    size = 0
    for tensor, (dtype, shape) in sorted(listed.items()):
        nbytes = _nbytes(dtype, shape)
        if size + nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][tensor] = (dtype, shape)
        size += nbytes
    index = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _write_sparse(folder / file, shard)
        index.update({tensor: file for tensor in shard})
    total = sum(_nbytes(*t) for t in listed.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1)
    )
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def _nbytes(dtype: str, shape: list[int]) -> int:
    n = {"U32": 4, "BF16": 2}[dtype]
    for dim in shape:
        n *= dim
    return n


def _write_sparse(path: Path, shard: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file with `shard`'s header and a hole where the data would be."""
    header: dict = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for tensor, (dtype, shape) in shard.items():
        end = offset + _nbytes(dtype, shape)
        header[tensor] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
