"""Export an HF checkpoint (llama, qwen2, qwen3) to a stateful Core ML `.mlpackage` via the MIL builder.

Graph interface (all rows share one call; each row has its own cursor):
  input_ids    [rows, q] int32
  attn_mask    [rows, 1, q, context] fp16, additive (0 = visible, large negative = hidden)
  position_ids [rows, q] int32; a NEGATIVE position marks a slot that writes nothing to the cache
  logits       [rows, q, vocab] fp32
  states       k_cache_<i>, v_cache_<i>: [rows, kv_heads, context, head_dim] fp16 per layer

Cache writes are a one-hot scatter: slot (r, i) writes its K/V at position_ids[r, i], and a
negative position matches no column, so rows that take no part in a call (prefill of another
row, idle rows in a decode) keep their cache bit for bit whatever their cursor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from converters.manifest import (
    DEFAULT_Q_SIZES,
    ConvertError,
    Manifest,
    graph_inputs,
    read_hf_config,
    source_sha256,
    write_manifest,
)
from converters.mlx_export import check_export_shape, copy_tokenizer

PACKAGE_NAME = "model.mlpackage"
METADATA_KEY = "llm_manifest"


@dataclass(frozen=True)
class ArchConfig:
    """The architecture numbers the graph needs, read from config.json."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config: dict) -> ArchConfig:
        scaling = config.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise ConvertError(f"unsupported rope_scaling {scaling!r} for Core ML export")
        heads = int(config["num_attention_heads"])
        return cls(
            model_type=config["model_type"],
            hidden_size=int(config["hidden_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads", heads)),
            head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
            vocab_size=int(config["vocab_size"]),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        )


def load_hf_weights(src: Path) -> dict[str, np.ndarray]:
    """All safetensors tensors of `src` as float32 numpy (mlx reads bf16, which numpy cannot)."""
    import mlx.core as mx

    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ConvertError(f"{src}: no *.safetensors weights")
    weights: dict[str, np.ndarray] = {}
    for file in files:
        for name, array in mx.load(str(file)).items():
            weights[name] = np.array(array.astype(mx.float32))
    return weights


def rope_tables(cfg: ArchConfig, context_length: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [context, head_dim] for rotate-half RoPE (mlx nn.RoPE, traditional=False)."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(half, dtype=np.float64) * 2 / cfg.head_dim))
    angles = np.arange(context_length, dtype=np.float64)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return np.cos(angles).astype(np.float16), np.sin(angles).astype(np.float16)


class _GraphBuilder:
    """Emits the decoder with mb.* ops; activations fp16, norms' statistics in fp32."""

    def __init__(self, cfg: ArchConfig, weights: dict[str, np.ndarray], context_length: int):
        self.cfg = cfg
        self.weights = weights
        self.context_length = context_length

    def const16(self, name: str) -> np.ndarray:
        return self.weights[name].astype(np.float16)

    def linear(self, x, prefix: str):
        bias = self.weights.get(prefix + ".bias")
        return self.mb.linear(
            x=x,
            weight=self.const16(prefix + ".weight"),
            bias=None if bias is None else bias.astype(np.float16),
        )

    def rms_norm(self, x, weight_name: str):
        # Sum of squares of fp16 activations overflows past ~256 per element: go to fp32.
        mb = self.mb
        x32 = mb.cast(x=x, dtype="fp32")
        mean_sq = mb.reduce_mean(x=mb.mul(x=x32, y=x32), axes=[-1], keep_dims=True)
        y = mb.mul(x=x32, y=mb.rsqrt(x=mean_sq, epsilon=self.cfg.rms_norm_eps))
        y = mb.mul(x=y, y=self.weights[weight_name].astype(np.float32))
        return mb.cast(x=y, dtype="fp16")

    def rope(self, x, cos, sin):
        # x: [rows, heads, q, hd]; cos/sin: [rows, 1, q, hd]
        mb, half = self.mb, self.cfg.head_dim // 2
        x1 = mb.slice_by_index(
            x=x, begin=[0, 0, 0, 0], end=[0, 0, 0, half], end_mask=[True] * 3 + [False]
        )
        x2 = mb.slice_by_index(x=x, begin=[0, 0, 0, half], end=[0, 0, 0, 0], end_mask=[True] * 4)
        rotated = mb.concat(values=[mb.mul(x=x2, y=np.float16(-1.0)), x1], axis=-1)
        return mb.add(x=mb.mul(x=x, y=cos), y=mb.mul(x=rotated, y=sin))

    def heads(self, x, prefix: str, count: int, norm: str | None):
        # [rows, q, count*hd] -> [rows, count, q, hd], with Qwen3's per-head RMSNorm
        mb, cfg = self.mb, self.cfg
        h = mb.reshape(x=self.linear(x, prefix), shape=[self.rows, -1, count, cfg.head_dim])
        if norm is not None and norm in self.weights:
            h = self.rms_norm(h, norm)
        return mb.transpose(x=h, perm=[0, 2, 1, 3])

    def write_cache(self, state, new, onehot, written):
        """Scatter `new` [rows, kv, q, hd] into the state at the one-hot positions."""
        mb = self.mb
        cache = mb.read_state(input=state)
        scattered = mb.matmul(x=onehot, y=new)  # [rows, 1, ctx, q] @ [rows, kv, q, hd]
        updated = mb.select(cond=written, a=scattered, b=cache)
        return mb.coreml_update_state(state=state, value=updated)

    def attention(self, x, layer: int, ctx):
        mb, cfg = self.mb, self.cfg
        p = f"model.layers.{layer}.self_attn."
        q = self.heads(x, p + "q_proj", cfg.num_heads, p + "q_norm.weight")
        k = self.heads(x, p + "k_proj", cfg.num_kv_heads, p + "k_norm.weight")
        v = self.heads(x, p + "v_proj", cfg.num_kv_heads, None)
        q = mb.mul(x=self.rope(q, ctx["cos"], ctx["sin"]), y=np.float16(cfg.head_dim**-0.5))
        k = self.rope(k, ctx["cos"], ctx["sin"])
        keys = self.write_cache(ctx["k_states"][layer], k, ctx["onehot"], ctx["written"])
        values = self.write_cache(ctx["v_states"][layer], v, ctx["onehot"], ctx["written"])
        # Grouped-query attention without repeating the cache: fold the group into q.
        groups = cfg.num_heads // cfg.num_kv_heads
        qg = mb.reshape(x=q, shape=[self.rows, cfg.num_kv_heads, -1, cfg.head_dim])
        scores = mb.matmul(x=qg, y=keys, transpose_y=True)  # [rows, kv, groups*q, ctx]
        scores = mb.reshape(
            x=scores, shape=[self.rows, cfg.num_kv_heads, groups, -1, self.context_length]
        )
        probs = mb.softmax(x=mb.add(x=scores, y=ctx["mask"]), axis=-1)
        probs = mb.reshape(x=probs, shape=[self.rows, cfg.num_kv_heads, -1, self.context_length])
        out = mb.matmul(x=probs, y=values)  # [rows, kv, groups*q, hd]
        out = mb.reshape(x=out, shape=[self.rows, cfg.num_heads, -1, cfg.head_dim])
        out = mb.transpose(x=out, perm=[0, 2, 1, 3])
        out = mb.reshape(x=out, shape=[self.rows, -1, cfg.num_heads * cfg.head_dim])
        return self.linear(out, p + "o_proj")

    def mlp(self, x, layer: int):
        mb, p = self.mb, f"model.layers.{layer}.mlp."
        gate = mb.silu(x=self.linear(x, p + "gate_proj"))
        return self.linear(mb.mul(x=gate, y=self.linear(x, p + "up_proj")), p + "down_proj")

    def positions(self, position_ids, attn_mask, k_states, v_states) -> dict:
        """Per-call tensors every layer shares: RoPE rows, one-hot write map, 5-D mask."""
        mb = self.mb
        cos_table, sin_table = rope_tables(self.cfg, self.context_length)
        clamped = mb.maximum(x=position_ids, y=np.int32(0))
        cos = mb.expand_dims(x=mb.gather(x=cos_table, indices=clamped, axis=0), axes=[1])
        sin = mb.expand_dims(x=mb.gather(x=sin_table, indices=clamped, axis=0), axes=[1])
        columns = np.arange(self.context_length, dtype=np.int32)
        hits = mb.equal(x=mb.expand_dims(x=position_ids, axes=[-1]), y=columns)  # [rows, q, ctx]
        hits16 = mb.cast(x=hits, dtype="fp16")
        onehot = mb.expand_dims(x=mb.transpose(x=hits16, perm=[0, 2, 1]), axes=[1])
        written = mb.reduce_max(x=hits16, axes=[1], keep_dims=False)  # [rows, ctx]
        written = mb.greater(x=mb.expand_dims(x=written, axes=[1, 3]), y=np.float16(0.5))
        mask = mb.expand_dims(x=attn_mask, axes=[2])  # [rows, 1, 1, q, ctx]
        return {
            "cos": cos,
            "sin": sin,
            "onehot": onehot,
            "written": written,
            "mask": mask,
            "k_states": k_states,
            "v_states": v_states,
        }

    def build(self, rows: int, progress: Callable[[Iterable], Iterable]):
        """The MIL program with symbolic q; returns (program, q symbol)."""
        import coremltools as ct
        from coremltools.converters.mil import Builder as mb
        from coremltools.converters.mil.mil import Function, Program, get_new_symbol, types

        self.mb, self.rows, cfg = mb, rows, self.cfg
        q = get_new_symbol()
        cache_shape = (rows, cfg.num_kv_heads, self.context_length, cfg.head_dim)
        specs = {
            "input_ids": mb.placeholder((rows, q), dtype=types.int32),
            "attn_mask": mb.placeholder((rows, 1, q, self.context_length), dtype=types.fp16),
            "position_ids": mb.placeholder((rows, q), dtype=types.int32),
        }
        for i in range(cfg.num_layers):
            specs[f"k_cache_{i}"] = mb.state_tensor_placeholder(cache_shape, dtype=types.fp16)
            specs[f"v_cache_{i}"] = mb.state_tensor_placeholder(cache_shape, dtype=types.fp16)
        with Function(specs, opset_version=ct.target.iOS18) as func:
            inputs = func.inputs
            k_states = [inputs[f"k_cache_{i}"] for i in range(cfg.num_layers)]
            v_states = [inputs[f"v_cache_{i}"] for i in range(cfg.num_layers)]
            ctx = self.positions(inputs["position_ids"], inputs["attn_mask"], k_states, v_states)
            embed = self.const16("model.embed_tokens.weight")
            x = mb.gather(x=embed, indices=inputs["input_ids"], axis=0)  # [rows, q, hidden]
            for layer in progress(range(cfg.num_layers)):
                p = f"model.layers.{layer}."
                x = mb.add(
                    x=x,
                    y=self.attention(self.rms_norm(x, p + "input_layernorm.weight"), layer, ctx),
                )
                x = mb.add(
                    x=x, y=self.mlp(self.rms_norm(x, p + "post_attention_layernorm.weight"), layer)
                )
            x = self.rms_norm(x, "model.norm.weight")
            head = embed if cfg.tie_word_embeddings else self.const16("lm_head.weight")
            logits = mb.cast(x=mb.linear(x=x, weight=head), dtype="fp32", name="logits")
            func.set_outputs([logits])
        program = Program()
        program.add_function("main", func)
        return program


def _identity(items: Iterable) -> Iterable:
    return items


def q_sizes_for(context_length: int) -> tuple[int, ...]:
    """Query lengths the graph accepts: decode (1) and the scoring chunks that fit the context."""
    return tuple(q for q in DEFAULT_Q_SIZES if q <= context_length)


def convert_program(program, rows: int, context_length: int, q_sizes: tuple[int, ...]):
    """Serialize the MIL program to an MLModel (not loaded: works on Linux).

    q is ENUMERATED, not ranged: from iOS18 Core ML accepts enumerated shapes on several inputs
    when every input lists the same number of shapes (shape i of each input go together), which
    keeps ids, mask and positions in lockstep and lets the ANE compile each size ahead of time;
    a RangeDim would force the dynamic-shape CPU/GPU path.
    """
    import coremltools as ct

    inputs = [
        ct.TensorType(
            name="input_ids",
            dtype=np.int32,
            shape=ct.EnumeratedShapes([(rows, q) for q in q_sizes]),
        ),
        ct.TensorType(
            name="attn_mask",
            dtype=np.float16,
            shape=ct.EnumeratedShapes([(rows, 1, q, context_length) for q in q_sizes]),
        ),
        ct.TensorType(
            name="position_ids",
            dtype=np.int32,
            shape=ct.EnumeratedShapes([(rows, q) for q in q_sizes]),
        ),
    ]
    # FLOAT32 here means "keep the dtypes the graph already has": it is fp16 by construction
    # with fp32 only where chosen (norm statistics, logits), which an fp16 pass would undo.
    return ct.convert(
        program,
        convert_to="mlprogram",
        inputs=inputs,
        minimum_deployment_target=ct.target.iOS18,
        compute_precision=ct.precision.FLOAT32,
        skip_model_load=True,
    )


def export_coreml(
    src: str | Path,
    out_dir: str | Path,
    *,
    rows: int = 4,
    context_length: int | None = None,
    dtype: str = "float16",
    source_hash: str | None = None,
    progress: Callable[[Iterable], Iterable] = _identity,
) -> Path:
    """Write `out_dir/model.mlpackage` (+ tokenizer files and manifest); returns the package path."""
    src, out = Path(src), Path(out_dir)
    config = read_hf_config(src)
    context_length = context_length or int(config.get("max_position_embeddings", 2048))
    check_export_shape(rows, context_length, config)
    if dtype != "float16":
        raise ConvertError("Core ML export is float16 only (its KV states are fp16)")
    cfg = ArchConfig.from_config(config)
    files = sorted(src.glob("*.safetensors"))
    weights = load_hf_weights(src)
    program = _GraphBuilder(cfg, weights, context_length).build(rows, progress)
    del weights
    q_sizes = q_sizes_for(context_length)
    manifest = Manifest(
        backend="coreml",
        model_type=cfg.model_type,
        rows=rows,
        context_length=context_length,
        dtype=dtype,
        vocab_size=cfg.vocab_size,
        q_sizes=q_sizes,
        inputs=graph_inputs(rows, context_length, "float16"),
        source_sha256=source_hash or source_sha256(files),
        extra={"num_layers": cfg.num_layers, "state_dtype": "float16"},
    )
    mlmodel = convert_program(program, rows, context_length, q_sizes)
    mlmodel.user_defined_metadata[METADATA_KEY] = manifest.to_json()
    out.mkdir(parents=True, exist_ok=True)
    package = out / PACKAGE_NAME
    mlmodel.save(str(package))
    copy_tokenizer(src, out)
    write_manifest(out, manifest)
    return package
