"""Import a llama.cpp `.gguf` file (llama, qwen2, qwen3) into an HF-layout folder mlx-lm loads.

Weights are dequantized with numpy (F32, F16, BF16, Q8_0, Q4_0, Q4_1), renamed to HF names, and
llama's Q/K rows are un-permuted; `config.json`, `tokenizer.json` and `tokenizer_config.json` are
rebuilt from the GGUF metadata. The folder appears atomically (written aside, then renamed).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from converters.gguf_dequant import dequantize_tensor

log = logging.getLogger(__name__)

SUPPORTED_ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
OUTPUT_DTYPES = ("float32", "float16", "bfloat16")
SHARD_BYTES = 4 << 30  # larger outputs are split into model-0000i-of-0000n.safetensors

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# Pre-tokenizer regexes as llama.cpp knows them by `tokenizer.ggml.pre`.
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = {"default", "gpt2", "mpt", "olmo", "jais"}
_DIGITS_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_QWEN2_PRE = {"qwen2", "stablelm2", "deepseek-r1-qwen", "hunyuan"}
_LLAMA3_PRE = {"llama-bpe", "llama3", "falcon3", "pixtral", "smaug-bpe"}

# llama.cpp token types (gguf.TokenType)
_TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 2, 3, 4


# ---------------------------------------------------------------- metadata


class _Meta:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader: Any, src: Path) -> None:
        self._fields = reader.fields
        self._src = src

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise ValueError(f"{self._src}: GGUF metadata key {key!r} is missing")
        return self.get(key)


def _short_float(x: float) -> float:
    """GGUF stores float32; print-round it so 1e-5 stays 1e-5 in config.json."""
    return float(str(np.float32(x)))


def _architecture(meta: _Meta) -> str:
    arch = meta.require("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"RoPE scaling {scaling!r} in this GGUF is not supported yet")
    return arch


def _build_config(meta: _Meta, arch: str, vocab_size: int, tied: bool, dtype: str) -> dict:
    """config.json in HF names, from `{arch}.*` metadata."""
    n_heads = int(meta.require(f"{arch}.attention.head_count"))
    hidden = int(meta.require(f"{arch}.embedding_length"))
    eos = _eos_ids(meta)
    return {
        "architectures": [SUPPORTED_ARCHS[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "num_hidden_layers": int(meta.require(f"{arch}.block_count")),
        "intermediate_size": int(meta.require(f"{arch}.feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        "head_dim": int(meta.get(f"{arch}.attention.key_length", hidden // n_heads)),
        "vocab_size": vocab_size,
        "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
        "rms_norm_eps": _short_float(meta.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _short_float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": arch == "qwen2",
        "mlp_bias": False,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": (eos or None) if len(eos) != 1 else eos[0],
        "torch_dtype": dtype,
    }


def _eos_ids(meta: _Meta) -> list[int]:
    """EOS plus the end-of-turn token when the GGUF names a different one."""
    ids = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    out: list[int] = []
    for i in ids:
        if i is not None and int(i) not in out:
            out.append(int(i))
    return out


# ---------------------------------------------------------------- tensors


def hf_tensor_name(name: str) -> str:
    """GGUF tensor name -> HF name (`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_RE.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        hint = " (Llama 3.1-style RoPE scaling)" if name.startswith("rope_freqs") else ""
        raise ValueError(f"GGUF tensor {name!r}{hint} is not supported by import_gguf")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's llama Q/K row permutation ([rows, ...] with rows = n_head*head_dim).

    llama.cpp stores each head's rows interleaved (pairs (i, i+half) -> rows 2i, 2i+1) for its
    rotary kernel; HF rotates halves. The forward permutation is
    `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2).reshape(w.shape)`.
    """
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _load_tensor(tensor: Any, arch: str, config: dict) -> np.ndarray:
    """Dequantize one tensor and undo llama's Q/K permutation where it applies."""
    w = dequantize_tensor(tensor)
    if arch == "llama":
        part = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if part == "attn_q":
            w = unpermute_qk(w, config["num_attention_heads"])
        elif part == "attn_k":
            w = unpermute_qk(w, config["num_key_value_heads"])
    return w


def _shards(tensors: list[Any], bytes_per_value: int) -> list[list[Any]]:
    """Group tensors (in file order) into shards of at most SHARD_BYTES."""
    shards: list[list[Any]] = [[]]
    size = 0
    for t in tensors:
        nbytes = int(t.n_elements) * bytes_per_value
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += nbytes
    return shards


def _write_weights(tensors: list[Any], arch: str, config: dict, out: Path, dtype: str) -> None:
    """Write `model.safetensors` (or shards plus an index), one shard in memory at a time."""
    shards = _shards(tensors, 4 if dtype == "float32" else 2)
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    for shard, fname in zip(shards, names, strict=True):
        arrays = {hf_tensor_name(t.name): _load_tensor(t, arch, config) for t in shard}
        _save_safetensors(arrays, out / fname, dtype)
        weight_map.update(dict.fromkeys(arrays, fname))
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _save_safetensors(arrays: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    if dtype == "bfloat16":  # numpy has no bfloat16; mlx writes it
        import mlx.core as mx

        mx.save_safetensors(
            str(path),
            {k: mx.array(v).astype(mx.bfloat16) for k, v in arrays.items()},
            {"format": "pt"},
        )
        return
    from safetensors.numpy import save_file

    np_dtype = np.float32 if dtype == "float32" else np.float16
    save_file(
        {k: v.astype(np_dtype) for k, v in arrays.items()}, str(path), metadata={"format": "pt"}
    )


# ---------------------------------------------------------------- tokenizer


def _pre_tokenizer(pre: str | None) -> Any:
    """The HF pre-tokenizer matching llama.cpp's `tokenizer.ggml.pre` name."""
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    split_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre in _DIGITS_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _QWEN2_PRE or pre in _LLAMA3_PRE:
        regex = Regex(_QWEN2_SPLIT if pre in _QWEN2_PRE else _LLAMA3_SPLIT)
        split = pre_tokenizers.Split(regex, behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, split_level])
    if pre is not None and pre not in _GPT2_PRE:
        log.warning("GGUF pre-tokenizer %r unknown; using GPT-2 byte-level splitting", pre)
    return byte_level


def _added_tokens(tokens: list[str], types: list[int]) -> tuple[list[Any], list[Any]]:
    """(special, plain) AddedTokens: control/unknown tokens are special, user-defined are not."""
    from tokenizers import AddedToken

    special, plain = [], []
    for content, kind in zip(tokens, types, strict=True):
        if kind in (_TOKEN_CONTROL, _TOKEN_UNKNOWN):
            special.append(AddedToken(content, special=True, normalized=False))
        elif kind == _TOKEN_USER_DEFINED:
            plain.append(AddedToken(content, special=False, normalized=False))
    return special, plain


def build_tokenizer(meta: _Meta) -> Any:
    """Rebuild a `tokenizers.Tokenizer` (byte-level BPE) from `tokenizer.ggml.*` metadata."""
    from tokenizers import Tokenizer, decoders, models, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported; import_gguf rebuilds byte-level BPE "
            "('gpt2') tokenizers only"
        )
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)  # duplicates keep their first id
    pre = meta.get("tokenizer.ggml.pre")
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _LLAMA3_PRE)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    special, plain = _added_tokens(tokens, types)
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(plain)
    template = _post_processor(meta, tokens)
    tokenizer.post_processor = template or processors.ByteLevel(trim_offsets=False)
    return tokenizer


def _post_processor(meta: _Meta, tokens: list[str]) -> Any:
    """A template adding BOS/EOS when the GGUF asks for it, else None."""
    from tokenizers import processors

    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if not (add_bos or add_eos):
        return None
    pre = [tokens[bos]] if add_bos else []
    post = [tokens[eos]] if add_eos else []
    specials = [(tokens[i], int(i)) for i, on in ((bos, add_bos), (eos, add_eos)) if on]
    return processors.TemplateProcessing(
        single=" ".join([*pre, "$A", *post]),
        pair=" ".join([*pre, "$A", *post, "$B:1", *post]),
        special_tokens=specials,
    )


def _tokenizer_config(meta: _Meta, context_length: int) -> dict:
    """tokenizer_config.json: chat template, special token strings, BOS behaviour."""
    tokens: list[str] = meta.require("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        i = meta.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    return config


# ---------------------------------------------------------------- entry point


def _open(src: Path) -> Any:
    from gguf import GGUFReader

    if not src.is_file():
        raise ValueError(f"GGUF file not found: {src}")
    try:
        return GGUFReader(src)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{src} is not a readable GGUF file: {exc}") from exc


def _write_folder(reader: Any, meta: _Meta, tmp: Path, dtype: str) -> None:
    """Write config, tokenizer and weights into the (temporary) folder `tmp`."""
    arch = _architecture(meta)
    tensors = list(reader.tensors)
    names = {t.name for t in tensors}
    if "token_embd.weight" not in names:
        raise ValueError("GGUF has no token_embd.weight tensor")
    embed = next(t for t in tensors if t.name == "token_embd.weight")
    vocab_size = int(embed.shape[-1])  # GGML order: [hidden, vocab]
    config = _build_config(meta, arch, vocab_size, "output.weight" not in names, dtype)
    tokenizer = build_tokenizer(meta)
    tokenizer.save(str(tmp / "tokenizer.json"))
    tok_config = _tokenizer_config(meta, config["max_position_embeddings"])
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _write_weights(tensors, arch, config, tmp, dtype)


def import_gguf(src: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Convert the GGUF file `src` into an HF-layout folder `out_dir` (must not exist or be empty).

    `dtype` is the stored weight type: float32 (default; fastest on CPU), float16 or bfloat16.
    Returns `out_dir`. On any error nothing is left at `out_dir`.
    """
    src, out = Path(src), Path(out_dir)
    if dtype not in OUTPUT_DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; choose one of {', '.join(OUTPUT_DTYPES)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output folder {out} already exists and is not empty; remove it first")
    reader = _open(src)
    meta = _Meta(reader, src)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_folder(reader, meta, tmp, dtype)
        if out.exists():
            out.rmdir()  # empty (checked above); rename needs the name free
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
