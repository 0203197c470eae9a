"""Speculative decoding on sampled and constrained rows (issue 19).

A verified draft is committed position by position: each position's token is drawn from the
row's processed distribution p (temperature, top_k, top_p, min_p, penalties, grammar mask)
exactly as plain decoding draws it, and the draft id x is kept iff the draw equals it. That is
the speculative-sampling rule for a deterministic drafter (q a point mass on x): x is kept
with probability p(x), and on rejection the token is distributed as p with x removed and
renormalised. Seeded rows draw the same numbers with speculation on or off, so their output
is identical; the distribution test checks the rule against exact probabilities.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from llm_server.decoding import Decoder, Sampler, SamplingParams
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings
from llm_server.scheduler import BatchScheduler, GenerationRequest
from llm_server.tokenizer import Tokenizer
from llm_server.tools.constrained import build_constraint
from tests.scheduler.helpers import Outcome, serve_together
from tests.scheduler.test_speculative import PLAIN, REPETITIVE, _same

K = 4


@pytest.fixture(scope="module")
def tok(tiny_model_path) -> Tokenizer:
    return Tokenizer(tiny_model_path)


def _serve(model, reqs, rows, speculative="off", hook=None) -> BatchScheduler:
    """Serve (request, outcome) pairs together on `rows` rows; the scheduler, closed."""
    return serve_together(
        lambda: MLXEngine(model, EngineSettings(rows=rows)),
        reqs,
        hook,
        timeout=120,
        max_concurrent=rows,
        max_queued=len(reqs),
        speculative=speculative,
        spec_tokens=K,
    )


def _request(tok, prompt, params: SamplingParams, constraint=None):
    out = Outcome()
    dec = Decoder(params, tok.eos_token_ids, tok.decode, constraint, prompt)
    return GenerationRequest(prompt, dec, out.emit), out


SAMPLED = SamplingParams(24, temperature=0.9, top_p=0.95, top_k=40, ignore_eos=True)


@pytest.mark.parametrize("how", ["ngram", "all-right", "all-wrong"])
def test_seeded_sampled_rows_equal_off(tiny_model_path, tok, how) -> None:
    prompts = REPETITIVE[:2] + PLAIN[:2]
    params = [SamplingParams(**{**SAMPLED.__dict__, "seed": 7 + i}) for i in range(4)]
    params[1] = SamplingParams(**{**params[1].__dict__, "repetition_penalty": 1.3})
    off = [_request(tok, p, sp) for p, sp in zip(prompts, params, strict=True)]
    _serve(tiny_model_path, off, 1)
    ref = {tuple(p): o.tokens for p, (_, o) in zip(prompts, off, strict=True)}

    def hook(req):
        nxt = ref[tuple(req.prompt)][len(req.decoder.tokens) :][:K]
        return [(t + 1) % 384 for t in nxt] if how == "all-wrong" else nxt

    on = [_request(tok, p, sp) for p, sp in zip(prompts, params, strict=True)]
    mode = "ngram" if how == "ngram" else "off"
    sched = _serve(tiny_model_path, on, 4, mode, None if how == "ngram" else hook)
    _same([o for _, o in on], [o for _, o in off])
    assert sched.drafted_tokens > 0
    if how == "all-right":
        assert sched.accepted_tokens == sched.drafted_tokens
    if how == "all-wrong":
        assert sched.accepted_tokens == 0


def _chi_square_z(counts: np.ndarray, probs: np.ndarray) -> float:
    """The chi-square statistic of `counts` against `probs`, as a standard normal z
    (Wilson-Hilferty); cells expected below 5 are pooled."""
    n = counts.sum()
    expect = probs * n
    small = expect < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expect[~small], expect[small].sum())
    stat = float(((obs - exp) ** 2 / np.maximum(exp, 1e-12)).sum())
    dof = obs.size - 1
    return ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))


def test_sampled_drafts_keep_the_distribution(tiny_model_path, tok) -> None:
    """The first 3 tokens of 1,600 seeded requests, each verifying a fixed 2-id draft after its
    first token (4 tokens, top_k 4), against the exact joint distribution from plain
    forwards: chi-square within 3.3 sigma, and the first draft id kept as often as p says."""
    prompt, top = PLAIN[0], 4
    params = SamplingParams(4, temperature=1.0, top_k=top, ignore_eos=True)
    engine = MLXEngine(tiny_model_path, EngineSettings(rows=1, prefix_cache_bytes=0))

    def dist(ids) -> dict[int, float]:
        p = Sampler(params).probabilities(engine.prefill(0, prompt + list(ids)))
        return {int(t): float(p[t]) for t in np.flatnonzero(p)}

    first = dist([])
    joint: dict[tuple[int, ...], float] = {}
    for t1, p1 in first.items():
        second = dist([t1])
        for t2, p2 in second.items():
            for t3, p3 in dist([t1, t2]).items():
                joint[(t1, t2, t3)] = p1 * p2 * p3
    # the draft: after the likeliest first token, its likeliest next two
    a = max(first, key=first.get)
    b = max((k for k in joint if k[0] == a), key=joint.get)[1:]
    draft = b
    n = 1600
    reqs = [
        _request(tok, prompt, SamplingParams(**{**params.__dict__, "seed": s})) for s in range(n)
    ]
    _serve(tiny_model_path, reqs, 8, hook=lambda req: draft if len(req.decoder.tokens) == 1 else ())
    keys = sorted(joint)
    counts = np.zeros(len(keys))
    at = {k: i for i, k in enumerate(keys)}
    for _, out in reqs:
        counts[at[tuple(out.tokens[:3])]] += 1
    probs = np.array([joint[k] for k in keys])
    assert abs(probs.sum() - 1) < 1e-6
    assert _chi_square_z(counts, probs) < 3.3
    # the rule itself: after first token t1, draft id x is kept with probability p(x | t1)
    kept = sum(out.tokens[1] == draft[0] for _, out in reqs)
    p_kept = sum(joint[k] for k in joint if k[1] == draft[0])
    assert abs(kept / n - p_kept) < 3.3 * math.sqrt(p_kept * (1 - p_kept) / n)
    assert 0 < kept < n  # both branches ran


SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "pair",
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
            "required": ["name", "n"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("how", ["ngram", "all-right", "all-wrong"])
def test_constrained_rows_verify_drafts_through_the_grammar(tiny_model_path, tok, how) -> None:
    """A grammar masks each verified position in turn and advances only on kept tokens, so a
    constrained row's output is the same with drafts (even ones the grammar forbids)."""
    prompts = REPETITIVE[:2] + PLAIN[:1]
    params = SamplingParams(40, temperature=0.0)

    def reqs():
        return [_request(tok, p, params, build_constraint(SCHEMA, tok, 384)) for p in prompts]

    off = reqs()
    _serve(tiny_model_path, off, 1)
    ref = {tuple(p): o.tokens for p, (_, o) in zip(prompts, off, strict=True)}
    for _, o in off:
        assert o.text.startswith("{")

    def hook(req):
        nxt = ref[tuple(req.prompt)][len(req.decoder.tokens) :][:K]
        return [(t + 1) % 384 for t in nxt] if how == "all-wrong" else nxt

    on = reqs()
    mode = "ngram" if how == "ngram" else "off"
    sched = _serve(tiny_model_path, on, 3, mode, None if how == "ngram" else hook)
    _same([o for _, o in on], [o for _, o in off])
    if how != "ngram":
        assert sched.drafted_tokens > 0
    if how == "all-right":
        assert sched.accepted_tokens == sched.drafted_tokens
    if how == "all-wrong":
        assert sched.accepted_tokens == 0
