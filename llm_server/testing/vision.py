"""Tiny random vision-language checkpoints built with mlx-vlm's own classes (tests make them).

Each folder is what an mlx-community upload holds: `config.json`, the weights (vision tower,
projector and language model, in mlx-vlm's names), the tokenizer of `tiny.py` plus the image
special tokens the family's processor needs, the image processor's and the processor's files,
and a chat template written after the family's real one (with its traps: Gemma 3 shows only
`{"type": "image"}` parts; SmolVLM renders plain-string content as nothing; LFM2-VL writes an
unknown part as JSON). `mlx_vlm.load` and this server both load them with no hub. Families:
`VLM_FAMILIES` (images served: Gemma 3, SmolVLM as idefics3 and as SmolVLM2's smolvlm,
LFM2-VL, Mistral 3 with Pixtral's tower) and `TEXT_ONLY_VLM_FAMILIES` (Qwen2.5-VL: text served, images refused).
"""

from __future__ import annotations

import json
from pathlib import Path

from llm_server.testing.tiny import EOS_TOKEN, build_tokenizer

# the real Gemma 3 template (google/gemma-3-*-it), shortened: images are {"type": "image"}
GEMMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
# the real SmolVLM template (HuggingFaceTB/SmolVLM-Instruct): string content renders as nothing
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# LFM2-VL's template after LiquidAI's: a part it does not know is written as JSON
LFM2_VL_TEMPLATE = (
    "{{- bos_token -}}{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{- '<image>' -}}"
    "{%- elif item['type'] == 'text' -%}{{- item['text'] -}}"
    "{%- else -%}{{- item | tojson -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{{- '<|im_end|>\n' -}}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

# the Qwen2.5-VL template, shortened: an image is a vision_start / image_pad / vision_end run
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Mistral 3 (Small 3.1) after its template: images are [IMG] markers inside [INST] turns
MISTRAL3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]{{ message['content'] }}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}{% if c['type'] == 'image' %}[IMG]"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}[/INST]"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)

VLM_FAMILIES = ("gemma3", "idefics3", "smolvlm", "lfm2_vl", "mistral3")  # images served
TEXT_ONLY_VLM_FAMILIES = ("qwen2_5_vl",)  # text served, images refused (M-RoPE positions)
_TEXT = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
}
_VISION = {
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "layer_norm_eps": 1e-6,
}
_OUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "out_proj.weight", "w2.weight")
_POST_NORMS = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")


def build_vlm_checkpoint(out_dir: str | Path, family: str, seed: int = 0) -> Path:
    """Write a tiny random `family` (of `VLM_FAMILIES` or `TEXT_ONLY_VLM_FAMILIES`) checkpoint
    to `out_dir`; its path."""
    build = {
        "gemma3": _gemma3,
        "idefics3": _idefics3,
        "smolvlm": _smolvlm,
        "lfm2_vl": _lfm2_vl,
        "mistral3": _mistral3,
        "qwen2_5_vl": _qwen,
    }
    if family not in build:
        raise ValueError(f"no tiny {family!r} checkpoint; one of {', '.join(build)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build[family](out, seed)
    return out


def _tokenizer(out: Path, specials: list[str], template: str, extra: dict) -> dict[str, int]:
    """The tiny BPE tokenizer with `specials` added, saved with `template`; token -> id."""
    from tokenizers import AddedToken

    tok = build_tokenizer(384)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 1024,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        **extra,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "chat_template.jinja").write_text(template)
    names = [*specials, EOS_TOKEN, "<|endoftext|>"]
    return {s: tok.token_to_id(s) for s in names} | {"vocab_size": tok.get_vocab_size()}


def _save(out: Path, config: dict, seed: int, tied: bool) -> None:
    """mlx-vlm's model for `config`, seeded, float32, with wide logit margins, saved."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map, tree_unflatten
    from mlx_vlm.utils import get_model_and_args, save_config, save_weights

    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(config)
    model_config.text_config = module.TextConfig.from_dict(config["text_config"])
    model_config.vision_config = module.VisionConfig.from_dict(config["vision_config"])
    mx.random.seed(seed)
    model = module.Model(model_config)
    model.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
    params = dict(tree_flatten(model.parameters()))
    changed = {}
    for k, v in params.items():
        if k.startswith("language_model.") and k.endswith(_OUT_PROJECTIONS) and tied:
            changed[k] = v * 6.0  # tied head: let the layers outweigh the input embedding
        elif k.startswith("language_model.") and k.endswith(_POST_NORMS) and v.ndim == 1:
            changed[k] = v + 5.0
        elif k.endswith("lm_head.weight"):
            changed[k] = v * 8.0
        elif "projector" in k or "connector" in k:  # random, not the init's ones
            changed[k] = mx.random.normal(v.shape) / (v.shape[-1] ** 0.5) * 4.0
    model.update(tree_unflatten(list(changed.items())))
    if tied and "lm_head" in model.language_model:  # the embeddings are the head (as in the
        del model.language_model["lm_head"]  # real checkpoints): no output layer saved
    mx.eval(model.parameters())
    save_weights(out, model)
    save_config(config, out / "config.json")


def _gemma3(out: Path, seed: int) -> None:
    from transformers import Gemma3ImageProcessor

    ids = _tokenizer(
        out,
        ["<bos>", "<pad>", "<start_of_turn>", "<end_of_turn>"]
        + ["<start_of_image>", "<end_of_image>", "<image_soft_token>"],
        GEMMA3_TEMPLATE,
        {
            "bos_token": "<bos>",
            "pad_token": "<pad>",
            "extra_special_tokens": {
                "boi_token": "<start_of_image>",
                "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>",
            },
        },
    )
    tokens_per_image = 4  # 4x4 patches of 8 pixels, pooled 2x2
    Gemma3ImageProcessor(
        size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    ).save_pretrained(out)
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": tokens_per_image}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
    text = {
        **_TEXT,
        "model_type": "gemma3_text",
        "vocab_size": ids["vocab_size"],
        "query_pre_attn_scalar": 16,
        "sliding_window": 8,  # windowed layers: a prompt of the tests reaches past them
        "sliding_window_pattern": 2,
        "mm_tokens_per_image": tokens_per_image,
        "rope_theta": 1_000_000.0,
        "rope_global_base_freq": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
    }
    vision = {**_VISION, "model_type": "siglip_vision_model", "patch_size": 8, "image_size": 32}
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "vocab_size": ids["vocab_size"],
        "hidden_size": text["hidden_size"],
        "image_token_index": ids["<image_soft_token>"],
        "pad_token_id": ids["<pad>"],
        "bos_token_id": ids["<bos>"],
        "eos_token_id": [ids["<end_of_turn>"], ids[EOS_TOKEN]],
        "mm_tokens_per_image": tokens_per_image,
    }
    _save(out, config, seed, tied=True)


def _smolvlm(out: Path, seed: int) -> None:
    """SmolVLM2: Idefics3's model and image layout, its own processor class and model_type."""
    _idefics3(out, seed, "smolvlm", "SmolVLMProcessor")


def _idefics3(
    out: Path, seed: int, model_type: str = "idefics3", processor_class: str = "Idefics3Processor"
) -> None:
    from transformers import Idefics3ImageProcessor

    tiles = [f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)]
    ids = _tokenizer(
        out,
        ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *tiles],
        SMOLVLM_TEMPLATE,
        {"bos_token": None},
    )
    tokens_per_tile = 4  # 4x4 patches of 8 pixels, pixel-shuffled by 2
    # images resized to a longest edge of 64 and split into tiles of 32 (plus the whole image)
    Idefics3ImageProcessor(
        size={"longest_edge": 64},
        max_image_size={"longest_edge": 32},
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    ).save_pretrained(out)
    processor = {"processor_class": processor_class, "image_seq_len": tokens_per_tile}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
    text = {
        **_TEXT,
        "model_type": "llama",
        "vocab_size": ids["vocab_size"],
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    vision = {**_VISION, "model_type": "idefics3", "patch_size": 8, "image_size": 32}
    config = {
        "model_type": model_type,
        "architectures": [f"{processor_class.removesuffix('Processor')}ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "vocab_size": ids["vocab_size"],
        "scale_factor": 2,
        "image_token_id": ids["<image>"],
        "eos_token_id": [ids["<end_of_utterance>"], ids[EOS_TOKEN]],
    }
    _save(out, config, seed, tied=False)


def _lfm2_vl(out: Path, seed: int) -> None:
    tiles = [f"<|img_row_{r}_col_{c}|>" for r in range(1, 5) for c in range(1, 5)]
    ids = _tokenizer(
        out,
        ["<|startoftext|>", "<image>", "<|image_start|>", "<|image_end|>", "<|img_thumbnail|>"]
        + tiles,
        LFM2_VL_TEMPLATE,
        {"bos_token": "<|startoftext|>"},
    )
    # small images: one tile of 16-pixel patches, pixel-unshuffled by 2, at least 16 positions
    # (the processor puts its own tiling defaults over these, as it does for real checkpoints)
    image = {
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
        "encoder_patch_size": 16,
        "downsample_factor": 2,
        "min_image_tokens": 16,
        "max_image_tokens": 64,
        "tile_size": 128,
        "max_num_patches": 256,
    }
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    processor = {"processor_class": "Lfm2VlProcessor", "use_image_special_tokens": True}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
    text = {
        **_TEXT,
        "model_type": "lfm2",
        "vocab_size": ids["vocab_size"],
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
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    vision = {
        **_VISION,
        "model_type": "siglip2_vision_model",
        "patch_size": 16,
        "num_patches": 256,
        "image_size": 256,
        "vision_use_head": False,
    }
    config = {
        "model_type": "lfm2_vl",
        "architectures": ["Lfm2VlForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "vocab_size": ids["vocab_size"],
        "image_token_id": ids["<image>"],
        "downsample_factor": 2,
        "encoder_patch_size": 16,
        "projector_hidden_size": 64,
        "projector_hidden_act": "gelu",
        "projector_bias": True,
        "projector_use_layernorm": True,
        "min_image_tokens": 16,
        "max_image_tokens": 64,
        "tile_size": 128,
        "max_num_patches": 256,
        "eos_token_id": ids[EOS_TOKEN],
    }
    _save(out, config, seed, tied=True)


def _qwen(out: Path, seed: int) -> None:
    from transformers import Qwen2VLImageProcessor

    ids = _tokenizer(
        out,
        ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
        QWEN_VL_TEMPLATE,
        {},
    )
    Qwen2VLImageProcessor(
        min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16, patch_size=14, merge_size=2
    ).save_pretrained(out)
    processor = {"processor_class": "Qwen2_5_VLProcessor"}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
    text = {k: v for k, v in _TEXT.items() if k != "head_dim"}  # 64 / 4 heads
    text.update(
        vocab_size=ids["vocab_size"],
        rope_theta=10000.0,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},  # head_dim 16 / 2
        tie_word_embeddings=False,
    )
    vision = {
        "model_type": "qwen2_5_vl",
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "out_hidden_size": text["hidden_size"],
        "num_heads": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "fullatt_block_indexes": [0],
        "in_channels": 3,
    }
    config = {
        "model_type": "qwen2_5_vl",
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        **text,  # the HF layout: the language model's entries at the top level
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "eos_token_id": ids[EOS_TOKEN],
        "vision_config": vision,
    }
    config["text_config"] = {k: v for k, v in config.items() if k != "vision_config"}
    _save(out, config, seed, tied=False)


def _mistral3(out: Path, seed: int) -> None:
    from mlx_vlm.models.pixtral.image_processing_pixtral import PixtralImageProcessor

    ids = _tokenizer(
        out,
        ["<s>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
        + ["[IMG]", "[IMG_BREAK]", "[IMG_END]"],
        MISTRAL3_TEMPLATE,
        {"bos_token": "<s>"},
    )
    # images resized to a longest edge of 64 in 16-pixel patches, merged 2x2: a row of
    # positions per two patch rows, [IMG_BREAK] between rows, [IMG_END] last
    PixtralImageProcessor(
        size={"longest_edge": 64},
        patch_size={"height": 16, "width": 16},
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    ).save_pretrained(out)
    processor = {"processor_class": "Mistral3Processor", "spatial_merge_size": 2}
    (out / "processor_config.json").write_text(json.dumps(processor, indent=2))
    text = {
        **_TEXT,
        "model_type": "mistral",
        "vocab_size": ids["vocab_size"],
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    vision = {
        **_VISION,
        "model_type": "pixtral",
        "head_dim": 16,
        "patch_size": 16,
        "image_size": 64,
        "rope_theta": 10000.0,
    }
    config = {
        "model_type": "mistral3",
        "architectures": ["Mistral3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "vocab_size": ids["vocab_size"],
        "image_token_index": ids["[IMG]"],
        "spatial_merge_size": 2,
        "vision_feature_layer": -1,
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": False,
        "eos_token_id": ids[EOS_TOKEN],
    }
    _save(out, config, seed, tied=False)
