"""A tiny random-weight checkpoint for the real coding agents (tests/agents).

The agents send 6-20k-character system prompts and tool lists, so the checkpoint differs from
`tiny.build_tiny_checkpoint`'s in four ways: 65,536 positions; a byte-level BPE vocabulary of
8,192 trained on this package's own sources (English docstrings, code, JSON), so an agent's
prompt is about a quarter as many tokens as characters; one layer with one 16-wide head, so
such a prompt is read in seconds; and an EOS that ends answers early.

The early EOS is built into the weights: every token's embedding carries a constant on one
hidden dimension (`_BIAS_DIM`), which survives the final RMSNorm as a near-constant input, and
the `lm_head` rows of the EOS and of `.` read that dimension. The sentence end `.` is then
likely at any step, and after a `.` (whose embedding also carries `_STOP_DIM`) the EOS is
the likeliest token, so answers are a few words long, greedy or sampled. The EOS row reads
nothing else, and no layer writes `_STOP_DIM` (its rows of `o_proj` and `down_proj` are zero),
so the EOS logit is exactly 0 after any token but `.`: an answer is never empty, which a random
EOS row made it in ~3% of sampled first tokens (the agents send no temperature). The template
is Hermes (`<tool_call>` JSON), so tools are served with the family's own parser.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from llm_server.testing.tiny import (
    _CORPUS,
    EOS_TOKEN,
    HERMES_TEMPLATE,
    TinySpec,
    _config,
    _weights,
    build_tokenizer,
    write_tokenizer_files,
)

AGENT_SPEC = TinySpec(
    arch="qwen3",
    hidden_size=64,
    num_layers=1,
    num_heads=1,
    num_kv_heads=1,
    intermediate_size=128,
    vocab_target=8192,
    max_position_embeddings=65536,
)
# One layer with one 16-wide head: MLX's CPU attention over a 16k-token prompt costs ~11 s per
# layer with 4 heads of 16 and ~3 s with one, and the agents' prompts are 10-20k tokens.
HEAD_DIM = 16
_BIAS_DIM, _STOP_DIM = 0, 1
BIAS_EMBED, STOP_EMBED = 4.0, 12.0  # the embedding values on those two dimensions
PERIOD_GAIN, EOS_GAIN = 3.0, 5.0  # lm_head weights reading them


def _corpus() -> list[str]:
    """This package's Python sources in path order: deterministic at a given commit."""
    root = Path(__file__).resolve().parents[1]
    return _CORPUS + [p.read_text(errors="replace") for p in sorted(root.rglob("*.py"))]


def build_agent_tokenizer(vocab_target: int):
    """A byte-level BPE tokenizer of `vocab_target` entries trained on `_corpus()`."""
    return build_tokenizer(vocab_target, _corpus())


def _early_eos(w: dict[str, np.ndarray], cfg: dict, eos_id: int, period_id: int) -> None:
    """Wire the constant and stop dimensions into the embeddings and the EOS/`.` rows."""
    for i in range(cfg["num_hidden_layers"]):
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            w[f"model.layers.{i}.{name}.weight"][_STOP_DIM] = 0.0
    emb = w["model.embed_tokens.weight"]
    emb[:, _BIAS_DIM] = BIAS_EMBED
    emb[:, _STOP_DIM] = 0.0
    emb[period_id, _STOP_DIM] = STOP_EMBED
    head = w["lm_head.weight"]
    head[:, _BIAS_DIM] = 0.0
    head[:, _STOP_DIM] = 0.0
    head[period_id, _BIAS_DIM] = PERIOD_GAIN
    head[eos_id] = 0.0
    head[eos_id, _STOP_DIM] = EOS_GAIN
    w["model.norm.weight"][[_BIAS_DIM, _STOP_DIM]] = 1.0


def build_agent_checkpoint(out_dir: str | Path, spec: TinySpec = AGENT_SPEC) -> Path:
    """Write the agents' checkpoint folder to `out_dir` (skipped when already complete)."""
    from safetensors.numpy import save_file

    out = Path(out_dir)
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = build_agent_tokenizer(spec.vocab_target)
    eos_id, bos_id = write_tokenizer_files(out, tok, spec.max_position_embeddings, HERMES_TEMPLATE)
    cfg = _config(spec, tok.get_vocab_size(), eos_id, bos_id) | {"head_dim": HEAD_DIM}
    weights = _weights(spec, cfg)
    _early_eos(weights, cfg, eos_id, tok.token_to_id("."))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    tmp = out / "model.safetensors.partial"
    save_file(weights, str(tmp), metadata={"format": "pt"})
    tmp.rename(out / "model.safetensors")
    return out


__all__ = ["AGENT_SPEC", "EOS_TOKEN", "build_agent_checkpoint", "build_agent_tokenizer"]
