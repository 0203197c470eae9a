"""Build tiny deterministic HF-layout checkpoints (Qwen3 or Llama) with a real BPE tokenizer.

Tests and benchmarks share these so nothing ever needs a download. The folder holds
`config.json`, `model.safetensors`, `tokenizer.json` and `tokenizer_config.json` (ChatML template).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Hermes/Qwen2.5-style tools template (`tools=` shown in the system turn, calls in <tool_call>).
_HERMES_BODY = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content or '' }}"
    "{% for tc in message.tool_calls or [] %}\n<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
)
HERMES_TEMPLATE = _HERMES_BODY + "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
# Qwen3-style thinking: the generation prompt opens <think> unless enable_thinking is false.
THINKING_TEMPLATE = _HERMES_BODY + (
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"

# A small fixed corpus so the BPE merges (and therefore token ids) are deterministic.
_CORPUS = [
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "Hello, how are you today? I am fine, thank you very much.",
    "Continuous batching lets several requests share one forward pass.",
    '{"name": "Alice", "age": 30, "tags": ["a", "b"], "ok": true, "value": null}',
    "def main():\n    print('hello world')\n    return 0\n",
    "One two three four five six seven eight nine ten. 0123456789",
    "Über café naïve résumé — ünïcödé 日本語 テキスト 😀 emoji",
]


@dataclass(frozen=True)
class TinySpec:
    """Shape of a tiny checkpoint; defaults give a ~0.2M-parameter model."""

    arch: str = "qwen3"  # "qwen3" | "llama" | "qwen2"
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    vocab_target: int = 384
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False  # tied random embeddings make greedy decoding repeat
    seed: int = 0


def build_tokenizer(vocab_target: int, corpus: list[str] | None = None):
    """Train a byte-level BPE tokenizer on `corpus` (default: the fixed corpus; deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_target,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4 if corpus is None else corpus, trainer=trainer)
    return tok


def _config(spec: TinySpec, vocab_size: int, eos_id: int, bos_id: int) -> dict:
    head_dim = spec.hidden_size // spec.num_heads
    arch = {
        "qwen3": ("Qwen3ForCausalLM", "qwen3"),
        "qwen2": ("Qwen2ForCausalLM", "qwen2"),
        "llama": ("LlamaForCausalLM", "llama"),
    }[spec.arch]
    return {
        "architectures": [arch[0]],
        "model_type": arch[1],
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "intermediate_size": spec.intermediate_size,
        "head_dim": head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def _weights(spec: TinySpec, cfg: dict) -> dict[str, np.ndarray]:
    """Random weights in HF naming, scaled so logits have useful (non-tied) margins."""
    rng = np.random.default_rng(spec.seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def mat(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) / np.sqrt(inp)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((v, h)).astype(np.float32)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = mat(nq * hd, h)
        w[p + "self_attn.k_proj.weight"] = mat(nkv * hd, h)
        w[p + "self_attn.v_proj.weight"] = mat(nkv * hd, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, nq * hd)
        if cfg["model_type"] == "qwen2":
            w[p + "self_attn.q_proj.bias"] = (0.1 * rng.standard_normal(nq * hd)).astype(np.float32)
            w[p + "self_attn.k_proj.bias"] = (0.1 * rng.standard_normal(nkv * hd)).astype(
                np.float32
            )
            w[p + "self_attn.v_proj.bias"] = (0.1 * rng.standard_normal(nkv * hd)).astype(
                np.float32
            )
        if cfg["model_type"] == "qwen3":
            w[p + "self_attn.q_norm.weight"] = norm(hd)
            w[p + "self_attn.k_norm.weight"] = norm(hd)
        w[p + "mlp.gate_proj.weight"] = mat(inter, h)
        w[p + "mlp.up_proj.weight"] = mat(inter, h)
        w[p + "mlp.down_proj.weight"] = mat(h, inter)
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
    w["model.norm.weight"] = norm(h)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = (3.0 * mat(v, h)).astype(np.float32)
    return w


def build_tiny_checkpoint(
    out_dir: str | Path, spec: TinySpec | None = None, chat_template: str = CHATML_TEMPLATE
) -> Path:
    """Write a tiny HF checkpoint folder to `out_dir` and return its path (idempotent)."""
    from safetensors.numpy import save_file

    spec = spec or TinySpec()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(spec.vocab_target)
    eos_id, bos_id = write_tokenizer_files(out, tok, spec.max_position_embeddings, chat_template)
    cfg = _config(spec, tok.get_vocab_size(), eos_id, bos_id)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(_weights(spec, cfg), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_tokenizer_files(
    out: Path, tok, max_length: int, chat_template: str = CHATML_TEMPLATE
) -> tuple[int, int]:
    """tokenizer.json and tokenizer_config.json (ChatML by default) in `out`; (eos, bos) ids."""
    eos_id = tok.token_to_id(EOS_TOKEN)
    bos_id = tok.token_to_id("<|endoftext|>")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "chat_template": chat_template,
                "eos_token": EOS_TOKEN,
                "bos_token": None,
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": max_length,
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    return eos_id, bos_id
