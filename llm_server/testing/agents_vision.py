"""A tiny random-weight Gemma 3 vision-language checkpoint for the real coding agents.

`vision.py`'s Gemma 3 checkpoint (built with mlx-vlm's own classes, its template and image
processor) with the language side of `agents.py`'s: 65,536 positions; the 8,192-entry byte-level
BPE vocabulary trained on this package's sources (plus Gemma 3's turn and image tokens), so a
10-20k-token agent prompt stays 10-20k tokens; one layer (global attention) with one 16-wide
head, so such a prompt is read in seconds; and an EOS that ends answers early. The template is
Gemma 3's, which shows no call syntax: the server serves tools in its generic format (tools
listed in the first turn, calls and results as `<tool_call>` text), as for a real Gemma 3.

The early EOS is built into the weights, as in `agents.py`, but Gemma 3's output layer is its
input embedding (mlx-vlm and the engine always tie it), so one table both writes and reads the
three wired dimensions, and the final norm's per-dimension gains (`1 + weight`) tell them apart:

- `_BIAS_DIM`: every token's embedding carries `BIAS_EMBED`, the `.` a little more; the final
  norm passes it on, so the `.` logit is raised by a near-constant margin at every step.
- `_STOP_DIM`: set in the embeddings of `.` and of `<end_of_turn>` (the EOS): after a `.`, the
  EOS (and the `.`) are raised by far more than any random logit.
- `_ANTI_DIM`: set in the `.` embedding only, with a negative final-norm gain: after a `.`, the
  `.` is pushed down again, so the EOS is the likeliest token.

No layer writes those dimensions (their rows of `o_proj` and `down_proj` are zero, and Gemma's
post-norms keep a zero a zero), so they hold the current token's embedding alone. The EOS row
reads nothing but the bias dimension, like every token's: after any token but `.` its logit is
an ordinary one, so an answer is never empty in practice. Sampled (the agents send no
temperature), answers are 2-15 tokens. Greedy decoding can still loop on a token whose tied
row reads its own embedding (seen once: `64` repeated to `max_tokens`); the agents never ask
for it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from llm_server.testing.agents import build_agent_tokenizer
from llm_server.testing.tiny import EOS_TOKEN
from llm_server.testing.vision import _VISION, GEMMA3_TEMPLATE, _save

VOCAB_TARGET = 8192
MAX_POSITIONS = 65536
TOKENS_PER_IMAGE = 16  # 4x4 patches of 8 pixels, one position each (no pooling)
IMAGE_SIZE = 32
_BIAS_DIM, _STOP_DIM, _ANTI_DIM = 0, 1, 2
BIAS_EMBED, PERIOD_EXTRA, STOP_EMBED = 1.0, 3.0, 4.0
BIAS_GAIN, STOP_GAIN, ANTI_GAIN = 3.0, 2.0, -4.0  # the final norm's multipliers (1 + weight)
GEMMA_SPECIALS = ["<bos>", "<pad>", "<start_of_turn>", "<end_of_turn>"] + [
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
]
EOS = "<end_of_turn>"


def _tokenizer(out: Path) -> dict[str, int]:
    """The agents' BPE with Gemma 3's specials, saved with the Gemma 3 template; token -> id."""
    from tokenizers import AddedToken

    tok = build_agent_tokenizer(VOCAB_TARGET)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in GEMMA_SPECIALS])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": GEMMA3_TEMPLATE,
        "bos_token": "<bos>",
        "eos_token": EOS,
        "pad_token": "<pad>",
        "unk_token": None,
        "model_max_length": MAX_POSITIONS,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "extra_special_tokens": {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "chat_template.jinja").write_text(GEMMA3_TEMPLATE)
    ids = {s: tok.token_to_id(s) for s in [*GEMMA_SPECIALS, EOS_TOKEN, "."]}
    return ids | {"vocab_size": tok.get_vocab_size()}


def _early_eos(path: Path, eos_id: int, period_id: int) -> None:
    """Rewrite `path`'s weights with the three wired dimensions (module docstring)."""
    import mlx.core as mx

    weights = {k: np.array(v) for k, v in mx.load(str(path)).items()}
    dims = [_BIAS_DIM, _STOP_DIM, _ANTI_DIM]
    for key, value in weights.items():
        if key.startswith("language_model.") and key.endswith(
            ("o_proj.weight", "down_proj.weight")
        ):
            value[dims] = 0.0
    emb = weights["language_model.model.embed_tokens.weight"]
    emb[:, dims] = 0.0
    emb[:, _BIAS_DIM] = BIAS_EMBED
    emb[period_id, _BIAS_DIM] += PERIOD_EXTRA
    emb[period_id, [_STOP_DIM, _ANTI_DIM]] = STOP_EMBED
    emb[eos_id] = 0.0
    emb[eos_id, _BIAS_DIM] = BIAS_EMBED
    emb[eos_id, _STOP_DIM] = STOP_EMBED
    norm = weights["language_model.model.norm.weight"]  # Gemma's RMSNorm scales by 1 + weight
    norm[dims] = np.array([BIAS_GAIN, STOP_GAIN, ANTI_GAIN], norm.dtype) - 1.0
    mx.save_safetensors(
        str(path), {k: mx.array(v) for k, v in weights.items()}, metadata={"format": "mlx"}
    )


def build_agent_vlm_checkpoint(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the agents' Gemma 3 VLM folder to `out_dir` (skipped when already complete: the
    folder is built beside it and renamed into place last)."""
    from transformers import Gemma3ImageProcessor

    out = Path(out_dir)
    if (out / "model.safetensors").exists():
        return out
    work = out.with_name(out.name + ".partial")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    ids = _tokenizer(work)
    Gemma3ImageProcessor(
        size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    ).save_pretrained(work)
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": TOKENS_PER_IMAGE}
    (work / "processor_config.json").write_text(json.dumps(processor, indent=2))
    text = {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "intermediate_size": 128,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "vocab_size": ids["vocab_size"],
        "query_pre_attn_scalar": 16,
        "sliding_window": 512,
        "sliding_window_pattern": 1,  # every layer global: the image stays in view
        "mm_tokens_per_image": TOKENS_PER_IMAGE,
        "rope_theta": 1_000_000.0,
        "rope_global_base_freq": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
    }
    vision = {
        **_VISION,
        "model_type": "siglip_vision_model",
        "patch_size": 8,
        "image_size": IMAGE_SIZE,
    }
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
        "eos_token_id": [ids[EOS], ids[EOS_TOKEN]],
        "mm_tokens_per_image": TOKENS_PER_IMAGE,
    }
    _save(work, config, seed, tied=True)
    _early_eos(work / "model.safetensors", ids[EOS], ids["."])
    shutil.rmtree(out, ignore_errors=True)
    work.rename(out)
    return out


__all__ = ["EOS", "TOKENS_PER_IMAGE", "build_agent_vlm_checkpoint"]
