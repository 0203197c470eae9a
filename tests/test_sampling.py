"""The sampling set on known logits: each parameter's exact change to the distribution."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llm_server.decoding import Decoder, LogitsConstraint, Sampler, SamplingParams, _draw, _top_k


def params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=16, **kw)


def softmax(x: list[float]) -> np.ndarray:
    e = np.exp(np.asarray(x, dtype=np.float64) - max(x))
    return e / e.sum()


def force(sampler: Sampler, token: int, vocab: int) -> None:
    """Make `sampler` emit `token` (its logit dwarfs the rest and any penalty)."""
    logits = np.zeros(vocab, dtype=np.float32)
    logits[token] = 1e4
    assert sampler(logits) == token


def test_top_k_one_equals_greedy():
    rng = np.random.default_rng(0)
    for seed in range(20):
        logits = rng.normal(size=500).astype(np.float32) * 3
        sampled = Sampler(params(temperature=1.5, top_k=1, seed=seed))(logits)
        greedy = Sampler(params(temperature=0.0))(logits)
        assert sampled == greedy == int(np.argmax(logits))


def test_top_k_mask_is_exact_and_keeps_ties():
    s = Sampler(params(temperature=1.0, top_k=2))
    probs = s.probabilities(np.array([4.0, 1.0, 3.0, 0.0, 2.0]))
    expected = np.zeros(5)
    expected[[0, 2]] = softmax([4.0, 3.0])
    np.testing.assert_allclose(probs, expected, rtol=1e-12)
    # a tie with the k-th logit stays in (HF's rule): three tokens share second place
    probs = s.probabilities(np.array([5.0, 2.0, 2.0, 2.0, 1.0]))
    np.testing.assert_allclose(probs, [*softmax([5.0, 2.0, 2.0, 2.0]), 0.0], rtol=1e-12)


def test_top_k_applies_after_temperature():
    s = Sampler(params(temperature=0.5, top_k=3))
    probs = s.probabilities(np.array([1.0, 2.0, 3.0, 4.0]))
    np.testing.assert_allclose(probs, [0.0, *softmax([4.0, 6.0, 8.0])], rtol=1e-12)


def test_min_p_mask_is_exact():
    p = [0.5, 0.3, 0.1, 0.06, 0.04]
    s = Sampler(params(temperature=1.0, min_p=0.15))  # threshold 0.15 * 0.5 = 0.075
    probs = s.probabilities(np.log(p))
    np.testing.assert_allclose(probs, [0.5 / 0.9, 0.3 / 0.9, 0.1 / 0.9, 0.0, 0.0], rtol=1e-12)


def test_min_p_after_top_p_and_draws_only_kept_tokens():
    s = Sampler(params(temperature=1.0, top_p=0.85, min_p=0.7, seed=3))
    # top_p keeps 0.5 and 0.4 (their sum reaches 0.85); min_p 0.7 keeps both (0.4 >= 0.35)
    probs = s.probabilities(np.log([0.5, 0.4, 0.06, 0.04]))
    np.testing.assert_allclose(probs, [0.5 / 0.9, 0.4 / 0.9, 0.0, 0.0], rtol=1e-12)
    s = Sampler(params(temperature=1.0, min_p=0.9, seed=3))
    draws = {s(np.log(np.array([0.5, 0.4, 0.06, 0.04], dtype=np.float32))) for _ in range(50)}
    assert draws == {0}  # only the top token is at least 0.9 * p(top)


def test_frequency_and_presence_penalties_follow_openai_arithmetic():
    vocab = 6
    s = Sampler(params(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.25))
    for token in (3, 3, 4):
        force(s, token, vocab)
    base = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 1.0], dtype=np.float32)
    # logit -= count * frequency_penalty + (count > 0) * presence_penalty
    expected = [2.0, -1.0, 0.5, 3.0 - (2 * 0.5 + 0.25), -2.0 - (1 * 0.5 + 0.25), 1.0]
    np.testing.assert_allclose(s.adjust(base), expected, rtol=1e-12)
    assert s(base) == 0  # greedy picks from the penalised logits: 3 fell to 1.75


def test_negative_penalties_raise_logits():
    s = Sampler(params(temperature=0.0, frequency_penalty=-1.0, presence_penalty=-2.0))
    force(s, 1, 3)
    np.testing.assert_allclose(s.adjust(np.zeros(3, dtype=np.float32)), [0.0, 3.0, 0.0])


def test_repetition_penalty_divides_positive_and_multiplies_negative_over_prompt_and_output():
    s = Sampler(params(temperature=0.0, repetition_penalty=2.0), prompt=[0, 1, 1])
    force(s, 4, 6)
    base = np.array([3.0, -1.0, 2.0, 0.5, 1.0, -3.0], dtype=np.float32)
    expected = [3.0 / 2, -1.0 * 2, 2.0, 0.5, 1.0 / 2, -3.0]  # seen: 0, 1 (prompt), 4 (output)
    np.testing.assert_allclose(s.adjust(base), expected, rtol=1e-12)


def test_bias_then_repetition_then_frequency_presence():
    s = Sampler(
        params(
            temperature=0.0,
            repetition_penalty=1.5,
            frequency_penalty=0.5,
            presence_penalty=0.25,
            logit_bias=((5, 2.0), (2, -1.0)),
        ),
        prompt=[0, 1],
    )
    for token in (3, 3, 4):
        force(s, token, 6)
    base = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 1.0], dtype=np.float32)
    expected = [
        2.0 / 1.5,
        -1.0 * 1.5,
        0.5 - 1.0,
        3.0 / 1.5 - (2 * 0.5 + 0.25),
        -2.0 * 1.5 - (0.5 + 0.25),
        1.0 + 2.0,
    ]
    np.testing.assert_allclose(s.adjust(base), expected, rtol=1e-12)
    assert s(base) == 5


def test_logit_bias_minus_100_bans_and_plus_100_forces():
    logits = np.array([1.0, 0.0, 9.0, 2.0, -1.0], dtype=np.float32)
    assert Sampler(params(temperature=0.0, logit_bias=((2, -100.0),)))(logits) == 3
    for seed in range(100):
        banned = Sampler(params(temperature=1.0, seed=seed, logit_bias=((2, -100.0),)))
        assert banned(logits) != 2
        forced = Sampler(params(temperature=1.0, seed=seed, logit_bias=((4, 100.0),)))
        assert forced(logits) == 4
    assert Sampler(params(temperature=0.0, logit_bias=((4, 100.0),)))(logits) == 4


def test_greedy_applies_penalties_before_argmax():
    s = Sampler(params(temperature=0.0, presence_penalty=1.0))
    logits = np.array([5.0, 4.5, 0.0], dtype=np.float32)
    # after 0: 4.0 vs 4.5 -> 1; after 1 too: 4.0 vs 3.5 -> 0 again
    assert [s(logits) for _ in range(3)] == [0, 1, 0]
    assert s.adjust(logits).tolist() == [4.0, 3.5, 0.0]


def test_defaults_leave_logits_alone_and_seeded_draws_repeat():
    p = params(temperature=0.8, seed=11)
    assert not p.reshapes_logits and not p.plain_greedy
    logits = np.random.default_rng(1).normal(size=200).astype(np.float32)
    assert Sampler(p).adjust(logits) is logits  # no copy when nothing is on
    a, b = Sampler(p), Sampler(p)
    assert [a(logits) for _ in range(30)] == [b(logits) for _ in range(30)]
    assert params(temperature=0.0).plain_greedy
    assert not params(temperature=0.0, logit_bias=((1, 1.0),)).plain_greedy


class _OnlyTokens(LogitsConstraint):
    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def mask(self, logits: np.ndarray) -> np.ndarray:
        out = np.full_like(logits, -np.inf)
        out[self.allowed] = logits[self.allowed]
        return out

    def advance(self, token: int) -> bool:
        return False


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constraint_mask_beats_bias_and_penalties(temperature):
    sp = params(
        temperature=temperature,
        seed=5,
        logit_bias=((3, 100.0),),
        presence_penalty=-2.0,
        repetition_penalty=0.5,
    )
    dec = Decoder(sp, frozenset(), lambda ids: "x" * len(ids), _OnlyTokens([1, 2]), prompt=[3])
    logits = np.array([0.0, 0.5, 0.4, 9.0], dtype=np.float32)
    for _ in range(5):
        assert dec.step(logits, room=100).token_id in (1, 2)


def test_logprobs_report_the_raw_distribution():
    sp = params(temperature=0.0, logit_bias=((0, 100.0),), logprobs=True)
    dec = Decoder(sp, frozenset(), lambda ids: "x" * len(ids))
    out = dec.step(np.array([0.0, 0.0], dtype=np.float32), room=10)
    assert out.token_id == 0
    assert out.logprob.logprob == pytest.approx(math.log(0.5))


def _nucleus_by_full_sort(logits: np.ndarray, top_p: float) -> np.ndarray:
    probs = softmax(list(logits))
    order = np.argsort(-probs, kind="stable")
    keep = order[: int(np.searchsorted(np.cumsum(probs[order]), top_p)) + 1]
    out = np.zeros_like(probs)
    out[keep] = probs[keep] / probs[keep].sum()
    return out


@pytest.mark.parametrize("scale", [8.0, 0.01])  # peaked (256 suffice) and flat (sorts more)
def test_top_p_matches_a_full_sort(scale):
    logits = np.random.default_rng(2).normal(size=5000) * scale
    s = Sampler(params(temperature=1.0, top_p=0.9))
    np.testing.assert_allclose(s.probabilities(logits), _nucleus_by_full_sort(logits, 0.9))


def test_top_k_near_the_top_equals_a_full_partition():
    rng = np.random.default_rng(4)
    for scale, k in ((4.0, 40), (0.5, 40), (40.0, 300), (4.0, 4999)):
        z = rng.normal(size=5000) * scale
        z[7] = z[8] = np.sort(z)[-k]  # a tie at the k-th
        kth = np.partition(z, z.size - k)[z.size - k]
        expected = np.flatnonzero(z >= kth)
        assert np.array_equal(np.sort(_top_k(z, k)), expected), (scale, k)


def test_block_draw_matches_a_full_inverse_cdf():
    rng = np.random.default_rng(6)
    probs = rng.random(5000) ** 8
    probs[rng.random(5000) < 0.3] = 0.0  # masked tokens are never drawn
    probs /= probs.sum()
    cdf = np.cumsum(probs)
    for u in rng.random(500):
        j = _draw(probs, float(u))
        assert j == int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        assert probs[j] > 0
