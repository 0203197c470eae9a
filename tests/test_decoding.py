"""llm_server/decoding.py: the sampling set on known logits (each parameter's exact change to the
distribution), and what a stream shows: stop-sequence hold-back and incremental detokenization,
token by token through a `Decoder` with the tiny checkpoint's and SmolLM2's real tokenizers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from llm_server.decoding import (
    Decoder,
    FinishReason,
    LogitsConstraint,
    Sampler,
    SamplingParams,
    _draw,
    _top_k,
)
from llm_server.tokenizer import Tokenizer


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


# -- what a stream shows: stop sequences and incremental detokenization ---------------------------
# Each test feeds a Decoder the token ids of a known text, one greedy step per token (the forced
# token's logit dwarfs the rest), and checks the text delta every step made safe to show.


def stream(
    tok: Tokenizer, ids: list[int], stop: tuple[str, ...] = (), max_tokens: int = 64
) -> tuple[list[str], FinishReason | None, list[int]]:
    """Decode `ids` as a generation: (each step's delta, the finish reason, tokens consumed)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=stop)
    dec = Decoder(sp, tok.eos_token_ids, tok.decode)
    deltas: list[str] = []
    for token in ids:
        logits = np.zeros(tok.vocab_size, dtype=np.float32)
        logits[token] = 1e4
        out = dec.step(logits, room=1000)
        assert out.token_id == token
        deltas.append(out.text)
        if out.finish is not None:
            return deltas, out.finish, dec.tokens
    return deltas, None, dec.tokens


def pieces(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_tiny_tokenizer_splits_the_texts_these_tests_rely_on(tiny_tokenizer):
    """The cases below need stops and characters that span tokens; this pins the split."""
    split = {
        "say hi END more": ["s", "ay", " ", "h", "i", " ", "E", "N", "D", " m", "o", "re"],
        "hello world": ["he", "llo", " ", "wor", "ld"],
    }
    for text, want in split.items():
        assert [tiny_tokenizer.decode([i]) for i in pieces(tiny_tokenizer, text)] == want
    assert len(pieces(tiny_tokenizer, "\U0001f642")) == 4  # one byte a token
    assert len(pieces(tiny_tokenizer, "\u20ac")) == 3


def test_a_stop_sequence_is_held_back_while_it_may_begin_and_never_shown(tiny_tokenizer):
    deltas, finish, tokens = stream(
        tiny_tokenizer, pieces(tiny_tokenizer, "say hi END more"), ("END",)
    )
    assert deltas == ["s", "ay", " ", "h", "i", " ", "", "", ""]  # E, N held; D completes it
    assert finish == FinishReason.STOP and len(tokens) == 9  # nothing sampled after the stop
    assert "".join(deltas) == "say hi "


def test_a_false_start_is_released_when_the_stop_cannot_match(tiny_tokenizer):
    deltas, finish, _ = stream(tiny_tokenizer, pieces(tiny_tokenizer, "ENTRY END"), ("END",))
    assert deltas == ["", "", "ENT", "R", "Y", " ", "", "", ""]
    assert finish == FinishReason.STOP and "".join(deltas) == "ENTRY "


def test_a_stop_inside_a_token_cuts_the_text_inside_it(tiny_tokenizer):
    deltas, finish, _ = stream(tiny_tokenizer, pieces(tiny_tokenizer, "hello world"), ("lo w",))
    assert deltas == ["he", "l", "", ""]  # "llo" shows only "l": "lo" may begin the stop
    assert finish == FinishReason.STOP and "".join(deltas) == "hel"


def test_the_earliest_of_several_stops_wins(tiny_tokenizer):
    deltas, finish, _ = stream(
        tiny_tokenizer, pieces(tiny_tokenizer, "say hi END more"), ("more", " h")
    )
    assert "".join(deltas) == "say" and finish == FinishReason.STOP


def test_held_back_text_is_shown_when_the_length_limit_ends_the_stream(tiny_tokenizer):
    ids = pieces(tiny_tokenizer, "say hi END")
    deltas, finish, _ = stream(tiny_tokenizer, ids, ("END",), max_tokens=8)  # ends after "EN"
    assert deltas[-2:] == ["", "EN"] and finish == FinishReason.LENGTH
    assert "".join(deltas) == "say hi EN"


def test_held_back_text_is_shown_at_eos_and_eos_adds_no_text(tiny_tokenizer):
    (eos,) = tiny_tokenizer.eos_token_ids
    deltas, finish, tokens = stream(
        tiny_tokenizer, [*pieces(tiny_tokenizer, "say hi EN"), eos], ("END",)
    )
    assert deltas[-3:] == ["", "", "EN"] and finish == FinishReason.STOP
    assert "".join(deltas) == "say hi EN" and tokens[-1] == eos


def test_a_multibyte_character_arrives_whole_in_the_step_that_completes_it(tiny_tokenizer):
    text = "caf\u00e9 \U0001f642 ok, 5\u20ac."
    deltas, finish, tokens = stream(tiny_tokenizer, pieces(tiny_tokenizer, text))
    assert finish is None and not any("\ufffd" in d for d in deltas)
    assert deltas[3:7] == ["", "", "", "\U0001f642"]  # four byte tokens, one character
    assert "".join(deltas) == text == tiny_tokenizer.decode(tokens)


def test_a_stop_made_of_a_multibyte_character_is_matched_whole(tiny_tokenizer):
    deltas, finish, _ = stream(
        tiny_tokenizer, pieces(tiny_tokenizer, "caf\u00e9 \U0001f642 ok"), ("\U0001f642",)
    )
    assert finish == FinishReason.STOP and "".join(deltas) == "caf\u00e9 "
    assert deltas[-4:] == ["", "", "", ""]


def test_a_stream_cut_inside_a_character_ends_as_the_tokenizer_decodes_it(tiny_tokenizer):
    ids = pieces(tiny_tokenizer, "ok \U0001f642")
    deltas, finish, tokens = stream(
        tiny_tokenizer, ids, max_tokens=len(ids) - 2
    )  # 2 of its 4 bytes
    assert finish == FinishReason.LENGTH
    assert deltas[-2] == "" and deltas[-1].endswith("\ufffd")  # the dangling bytes, flushed
    assert "".join(deltas) == tiny_tokenizer.decode(tokens)


@pytest.mark.parametrize(
    ("text", "stop"),
    [
        ("say hi END more", ("END",)),
        ("ENTRY END", ("ENTRY END",)),
        ("hello world", ("o", "wor")),
        ("caf\u00e9 \U0001f642 ok, 5\u20ac.", ("\u20ac",)),
        ("caf\u00e9 \U0001f642 ok, 5\u20ac.", ("absent",)),
    ],
)
def test_the_stream_shows_exactly_the_text_before_the_first_stop(tiny_tokenizer, text, stop):
    deltas, _, _ = stream(tiny_tokenizer, pieces(tiny_tokenizer, text), stop)
    first = min((i for s in stop if (i := text.find(s)) >= 0), default=len(text))
    assert "".join(deltas) == text[:first]


@pytest.mark.slow
def test_smollm2_streams_split_characters_whole_and_holds_a_stop_back(default_model_path):
    tok = Tokenizer(default_model_path)
    ids = pieces(tok, "\u6f22\u5b57 ok")  # the first character is three byte tokens
    deltas, finish, _ = stream(tok, ids)
    assert deltas == ["", "", "\u6f22", "\u5b57", " ok"] and finish is None
    ids = pieces(tok, "na\u00efve \u00df")  # " \u00df" is two tokens: the space waits too
    assert stream(tok, ids)[0] == ["na", "\u00efve", "", " \u00df"]
    deltas, finish, _ = stream(tok, pieces(tok, "Hello, world! The end."), (" The e",))
    assert deltas == ["Hello", ",", " world", "!", "", ""] and finish == FinishReason.STOP
