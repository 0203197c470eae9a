"""A vision-language checkpoint of a real model's shapes for the vision workload, built here
(no hub): SmolVLM-256M-Instruct's architecture (Idefics3: a SigLIP tower of 12 layers at 768
wide over 512-pixel tiles of 16-pixel patches, pixel-shuffled by 4 into 64 positions per
tile; SmolLM2-135M's 30-layer language model) with random weights and SmolLM2's own
tokenizer (from the embedded default model) plus the image tokens. Random weights answer
nonsense, but every forward costs what the real model's costs.

    python -m llm_server.benchmark.vision_checkpoint OUT_DIR
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from llm_server.testing.vision import SMOLVLM_TEMPLATE, _save

TILES = [f"<row_{r}_col_{c}>" for r in range(1, 5) for c in range(1, 5)]
SPECIALS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", *TILES]
TEXT = {  # SmolLM2-135M
    "model_type": "llama",
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": False,  # as mlx-vlm loads Idefics3 (the head costs the same)
}
VISION = {  # SmolVLM-256M's SigLIP
    "model_type": "idefics3",
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "patch_size": 16,
    "image_size": 512,
    "layer_norm_eps": 1e-6,
}
TOKENS_PER_TILE = 64  # (512 / 16)^2 patches / 4^2


def build_bench_vlm(out_dir: str | Path, seed: int = 0) -> Path:
    """Write the checkpoint to `out_dir` (skipped when complete); its path."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import Idefics3ImageProcessor

    from llm_server.default_model import default_model_path

    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.save(str(tmp / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": SMOLVLM_TEMPLATE,
        "eos_token": "<end_of_utterance>",
        "bos_token": None,
        "pad_token": "<|endoftext|>",
        "model_max_length": TEXT["max_position_embeddings"],
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (tmp / "chat_template.jinja").write_text(SMOLVLM_TEMPLATE)
    Idefics3ImageProcessor(
        size={"longest_edge": 512},
        max_image_size={"longest_edge": 512},
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    ).save_pretrained(tmp)
    processor = {"processor_class": "Idefics3Processor", "image_seq_len": TOKENS_PER_TILE}
    (tmp / "processor_config.json").write_text(json.dumps(processor, indent=2))
    vocab = tok.get_vocab_size()
    model = {
        "model_type": "idefics3",
        "architectures": ["Idefics3ForConditionalGeneration"],
        "text_config": {**TEXT, "vocab_size": vocab},
        "vision_config": VISION,
        "vocab_size": vocab,
        "scale_factor": 4,
        "image_token_id": tok.token_to_id("<image>"),
        "eos_token_id": [tok.token_to_id("<end_of_utterance>")],
    }
    _save(tmp, model, seed, tied=False)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m llm_server.benchmark.vision_checkpoint OUT_DIR")
    print(build_bench_vlm(sys.argv[1]))
