"""A numpy reference forward of the tiny llama checkpoint: final-norm hidden states, pooled.

Written from the Llama definition (RMSNorm, half-split RoPE, grouped-query causal attention,
SwiGLU), independent of MLX and of our engine, so embeddings can be checked against it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


class ReferenceLlama:
    def __init__(self, path: Path) -> None:
        from safetensors.numpy import load_file

        self.cfg = json.loads((path / "config.json").read_text())
        if self.cfg["model_type"] != "llama":
            raise ValueError("the reference forward is written for the llama checkpoint")
        self.w = {
            k: v.astype(np.float64) for k, v in load_file(str(path / "model.safetensors")).items()
        }

    def _rms(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.cfg["rms_norm_eps"]) * weight

    def hidden(self, ids: list[int]) -> np.ndarray:
        """Final-norm hidden states [T, hidden] of one sequence."""
        c, w = self.cfg, self.w
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        t = len(ids)
        half = hd // 2
        inv = c["rope_theta"] ** (-np.arange(0, hd, 2) / hd)  # [hd/2]
        ang = np.arange(t)[:, None] * inv[None, :]  # [T, hd/2]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

        def rope(x: np.ndarray) -> np.ndarray:  # x [T, heads, hd]
            x1, x2 = x[..., :half], x[..., half:]
            return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)

        causal = np.tril(np.ones((t, t), dtype=bool))
        x = w["model.embed_tokens.weight"][ids]  # [T, hidden]
        for i in range(c["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = self._rms(x, w[p + "input_layernorm.weight"])
            q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, nh, hd))
            k = rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, nkv, hd))
            v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, nkv, hd)
            k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
            scores = np.where(causal[None], scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", probs, v).reshape(t, nh * hd)
            x = x + attn @ w[p + "self_attn.o_proj.weight"].T
            h = self._rms(x, w[p + "post_attention_layernorm.weight"])
            gate = h @ w[p + "mlp.gate_proj.weight"].T
            up = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
        return self._rms(x, w["model.norm.weight"])

    def embed(self, ids: list[int], pooling: str, normalize: bool) -> np.ndarray:
        h = self.hidden(ids)
        vec = {"last": h[-1], "mean": h.mean(0), "cls": h[0]}[pooling]
        return vec / np.linalg.norm(vec) if normalize else vec
