"""GGUF import: hand-packed block dequantization, and tiny checkpoints round-tripped through GGUF."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.numpy import load_file

from converters.gguf_dequant import dequantize_q4_0, dequantize_q4_1, dequantize_q8_0
from converters.gguf_import import import_gguf, unpermute_qk
from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint

QK = 32
F32_LOGIT_TOL = 1e-5
# fp16 weights carry ~2^-11 relative error; through two tiny layers the logits (|x| ~ 10) move
# by ~6e-3 (measured), well inside this bound.
F16_LOGIT_TOL = 2e-2
SAMPLE_TEXTS = [
    "The capital of France is Paris.",
    "Über café naïve — 日本語 テキスト 😀",
    "def main():\n    return 0  # 0123456789",
    "<|im_start|>user\nhi<|im_end|>",
]

# ---------------------------------------------------------------- hand-written block decoders


def _ref_decode(raw: bytes, kind: str) -> list[float]:
    """Decode ggml blocks one element at a time, straight from the block layout."""
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[kind]
    out: list[float] = []
    for start in range(0, len(raw), size):
        block = raw[start : start + size]
        (d,) = struct.unpack("<e", block[0:2])
        if kind == "Q8_0":
            out += [q * d for q in struct.unpack("<32b", block[2:])]
            continue
        m = struct.unpack("<e", block[2:4])[0] if kind == "Q4_1" else 0.0
        packed = block[4:] if kind == "Q4_1" else block[2:]
        nibbles = [b & 0x0F for b in packed] + [b >> 4 for b in packed]
        out += [q * d + m if kind == "Q4_1" else (q - 8) * d for q in nibbles]
    return out


def _pack_q8_0(d: float, qs: list[int]) -> bytes:
    return struct.pack("<e", d) + struct.pack("<32b", *qs)


def _pack_nibbles(qs: list[int]) -> bytes:
    return bytes(lo | (hi << 4) for lo, hi in zip(qs[:16], qs[16:], strict=True))


def _as_rows(raw: bytes, rows: int) -> np.ndarray:
    return np.frombuffer(raw, dtype=np.uint8).reshape(rows, -1)


def test_q8_0_hand_packed_blocks() -> None:
    qs_a = list(range(-16, 16))
    qs_b = [127, -128, 0, 1, -1] + [5] * 27
    raw = _pack_q8_0(0.5, qs_a) + _pack_q8_0(-0.125, qs_b) + _pack_q8_0(2.0, qs_b[::-1])
    raw += _pack_q8_0(0.0, qs_a)
    got = dequantize_q8_0(_as_rows(raw, 2))
    assert got.shape == (2, 64)
    assert got[0, :32].tolist() == [q * 0.5 for q in qs_a]
    assert got[0, 32:35].tolist() == [-15.875, 16.0, -0.0]
    np.testing.assert_array_equal(got.ravel(), np.array(_ref_decode(raw, "Q8_0"), np.float32))
    assert not got[1, 32:].any()


def test_q4_0_hand_packed_blocks() -> None:
    qs = list(range(16)) + list(range(15, -1, -1))
    raw = (
        struct.pack("<e", 0.25)
        + _pack_nibbles(qs)
        + struct.pack("<e", -3.0)
        + _pack_nibbles(qs[::-1])
    )
    got = dequantize_q4_0(_as_rows(raw, 1))
    assert got.shape == (1, 64)
    assert got[0, :32].tolist() == [(q - 8) * 0.25 for q in qs]
    assert got[0, 0] == -2.0 and got[0, 15] == 1.75 and got[0, 16] == 1.75
    np.testing.assert_array_equal(got.ravel(), np.array(_ref_decode(raw, "Q4_0"), np.float32))


def test_q4_1_hand_packed_blocks() -> None:
    qs = [(7 * i + 3) % 16 for i in range(32)]
    raw = struct.pack("<ee", 0.125, -1.0) + _pack_nibbles(qs)
    raw += struct.pack("<ee", 1.5, 0.25) + _pack_nibbles(qs[::-1])
    got = dequantize_q4_1(_as_rows(raw, 2))
    assert got.shape == (2, 32)
    assert got[0].tolist() == [q * 0.125 - 1.0 for q in qs]
    assert got[1].tolist() == [q * 1.5 + 0.25 for q in qs[::-1]]
    np.testing.assert_array_equal(got.ravel(), np.array(_ref_decode(raw, "Q4_1"), np.float32))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_quants_roundtrip_within_format_bound(kind: str) -> None:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((8, 4 * QK)) * rng.uniform(0.01, 3, (8, 1))).astype(np.float32)
    qtype = GGMLQuantizationType[kind]
    raw = quants.quantize(x, qtype)
    ours = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1}[kind](raw)
    np.testing.assert_array_equal(ours, quants.dequantize(raw, qtype))
    np.testing.assert_array_equal(
        ours.ravel(), np.array(_ref_decode(raw.tobytes(), kind), np.float32)
    )
    blocks, err = x.reshape(-1, QK), np.abs(ours - x).reshape(-1, QK).max(axis=1)
    assert (err <= _block_bound(blocks, kind)).all()


def _block_bound(blocks: np.ndarray, kind: str) -> np.ndarray:
    """Worst-case error per block: half a step, plus fp16 rounding of the scale (and min).

    Q4_0 maps the largest-magnitude value to -8 steps, so the opposite sign only reaches +7
    steps: values there clip by up to one whole step.
    """
    amax = np.abs(blocks).max(axis=1)
    if kind == "Q8_0":
        return 0.5 * amax / 127 + amax * 2.0**-9
    if kind == "Q4_0":
        return amax / 8 + amax * 2.0**-9
    step = (blocks.max(axis=1) - blocks.min(axis=1)) / 15
    return 0.5 * step + amax * 2.0**-9


# ---------------------------------------------------------------- GGUF files from tiny checkpoints

_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_HF_LAYER_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf: str) -> str:
    if hf in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf]
    _, _, layer, *mid, kind = hf.split(".")
    return f"blk.{layer}.{_HF_LAYER_TO_GGUF['.'.join(mid)]}.{kind}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _encode_tensor(w: np.ndarray, kind: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    """Norms (1-D) stay F32 as llama.cpp keeps them; matrices take `kind`."""
    if w.ndim == 1 or kind == "F32":
        return w.astype(np.float32), GGMLQuantizationType.F32
    if kind == "F16":
        return w.astype(np.float16), GGMLQuantizationType.F16
    qtype = GGMLQuantizationType[kind]
    return quants.quantize(w, qtype), qtype


def _write_tokenizer_metadata(writer: GGUFWriter, ckpt: Path) -> None:
    tok = json.loads((ckpt / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["id"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    cfg = json.loads((ckpt / "config.json").read_text())
    template = json.loads((ckpt / "tokenizer_config.json").read_text())["chat_template"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(template)


def write_gguf(ckpt: Path, path: Path, kind: str = "F32") -> Path:
    """Write a tiny HF checkpoint as llama.cpp would (Q/K permuted for llama)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    arch = cfg["model_type"]
    writer = GGUFWriter(path, arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(cfg["head_dim"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    _write_tokenizer_metadata(writer, ckpt)
    for hf, w in load_file(str(ckpt / "model.safetensors")).items():
        if arch == "llama" and hf.endswith("q_proj.weight"):
            w = _llama_cpp_permute(w, cfg["num_attention_heads"])
        elif arch == "llama" and hf.endswith("k_proj.weight"):
            w = _llama_cpp_permute(w, cfg["num_key_value_heads"])
        data, qtype = _encode_tensor(w, kind)
        writer.add_tensor(_gguf_name(hf), data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp(request.param), TinySpec(arch=request.param)
    )


def _logits(folder: Path, ids: list[int]) -> np.ndarray:
    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(folder))
    out = model(mx.array([ids]))
    mx.eval(out)
    return np.array(out.astype(mx.float32))


PROMPT_IDS = [5, 17, 42, 99, 3, 250, 7, 1, 120, 64]


@pytest.mark.parametrize("kind, tol", [("F32", F32_LOGIT_TOL), ("F16", F16_LOGIT_TOL)])
def test_roundtrip_logits_match_original(tiny: Path, tmp_path: Path, kind: str, tol: float) -> None:
    out = import_gguf(write_gguf(tiny, tmp_path / "m.gguf", kind), tmp_path / "hf")
    diff = np.abs(_logits(out, PROMPT_IDS) - _logits(tiny, PROMPT_IDS)).max()
    assert diff <= tol, f"{kind}: max |logit diff| {diff}"
    if kind == "F32":  # the un-permuted weights are bit-identical to the checkpoint's
        ours, orig = (
            load_file(str(out / "model.safetensors")),
            load_file(str(tiny / "model.safetensors")),
        )
        assert ours.keys() == orig.keys()
        for name in orig:
            np.testing.assert_array_equal(ours[name], orig[name], err_msg=name)


# Half-precision outputs also compute in that precision (measured: ~1.4e-2 fp16, ~0.14 bf16).
@pytest.mark.parametrize("dtype, tol", [("float16", 5e-2), ("bfloat16", 0.5)])
def test_half_precision_outputs(tmp_path: Path, dtype: str, tol: float) -> None:
    import mlx.core as mx

    tiny = build_tiny_checkpoint(tmp_path / "ckpt", TinySpec(arch="llama"))
    out = import_gguf(write_gguf(tiny, tmp_path / "m.gguf"), tmp_path / "hf", dtype=dtype)
    stored = mx.load(str(out / "model.safetensors"))
    assert {str(w.dtype) for w in stored.values()} == {f"mlx.core.{dtype}"}
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == dtype
    assert np.abs(_logits(out, PROMPT_IDS) - _logits(tiny, PROMPT_IDS)).max() <= tol


def test_roundtrip_config(tiny: Path, tmp_path: Path) -> None:
    out = import_gguf(write_gguf(tiny, tmp_path / "m.gguf"), tmp_path / "hf")
    ours, orig = (json.loads((f / "config.json").read_text()) for f in (out, tiny))
    keys = [
        "model_type", "architectures", "hidden_size", "num_hidden_layers", "intermediate_size",
        "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps",
        "rope_theta", "max_position_embeddings", "tie_word_embeddings", "eos_token_id",
        "bos_token_id", "torch_dtype",
    ]  # fmt: skip
    assert {k: ours[k] for k in keys} == {k: orig[k] for k in keys}


def test_roundtrip_tokenizer_same_ids(tiny: Path, tmp_path: Path) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    out = import_gguf(write_gguf(tiny, tmp_path / "m.gguf"), tmp_path / "hf")
    ours, orig = load_tokenizer(out), load_tokenizer(tiny)
    chat = [{"role": "user", "content": "Quelle est la capitale de la France ? ✓"}]
    rendered = orig.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == rendered
    for text in [*SAMPLE_TEXTS, rendered]:
        ids = orig.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == text
    assert ours.eos_token_ids == orig.eos_token_ids


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_quantized_llama_import_unpermutes_within_bound(tmp_path: Path, kind: str) -> None:
    """Quantized Q/K rows are dequantized, then un-permuted: weights stay within the format bound."""
    tiny = build_tiny_checkpoint(tmp_path / "ckpt", TinySpec(arch="llama"))
    out = import_gguf(write_gguf(tiny, tmp_path / "m.gguf", kind), tmp_path / "hf")
    ours, orig = (
        load_file(str(out / "model.safetensors")),
        load_file(str(tiny / "model.safetensors")),
    )
    for name, w in orig.items():
        err = (
            np.abs(ours[name] - w).reshape(-1, QK).max(axis=1)
            if w.ndim == 2
            else np.abs(ours[name] - w)
        )
        bound = _block_bound(w.reshape(-1, QK), kind) if w.ndim == 2 else 0.0
        assert (err <= bound).all(), name


def test_unpermute_inverts_llama_cpp_permute() -> None:
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    for n_head in (1, 2, 6):
        np.testing.assert_array_equal(unpermute_qk(_llama_cpp_permute(w, n_head), n_head), w)
    bias = np.arange(48, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_qk(_llama_cpp_permute(bias, 4), 4), bias)


# ---------------------------------------------------------------- errors and atomicity


def _minimal_gguf(path: Path, arch: str, tensor: np.ndarray, qtype: GGMLQuantizationType) -> Path:
    writer = GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", tensor, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_unsupported_architecture(tmp_path: Path) -> None:
    src = _minimal_gguf(
        tmp_path / "g.gguf", "gemma", np.zeros((4, 32), np.float32), GGMLQuantizationType.F32
    )
    with pytest.raises(
        ValueError, match="architecture 'gemma' is not supported.*llama, qwen2, qwen3"
    ):
        import_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def test_unsupported_tensor_type_leaves_nothing(tiny: Path, tmp_path: Path) -> None:
    src = write_gguf(tiny, tmp_path / "m.gguf", "Q5_0")
    with pytest.raises(ValueError, match="type Q5_0.*supported: F32, F16, Q8_0, Q4_0, Q4_1"):
        import_gguf(src, tmp_path / "out")
    assert not (tmp_path / "out").exists() and not _leftovers(tmp_path)


def test_missing_file_and_bad_arguments(tiny: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="GGUF file not found"):
        import_gguf(tmp_path / "nope.gguf", tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        import_gguf(tmp_path / "junk.gguf", tmp_path / "out")
    src = write_gguf(tiny, tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="dtype 'int8' not supported"):
        import_gguf(src, tmp_path / "out", dtype="int8")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="already exists and is not empty"):
        import_gguf(src, tmp_path / "full")
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
