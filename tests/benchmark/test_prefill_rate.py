"""benchmark/prefill_rate: the prompts it times and one measurement in a fresh process."""

from __future__ import annotations

from llm_server.benchmark import prefill_rate


def test_a_warm_store_warm_up_is_as_long_and_shares_no_prefix():
    cold_warmup, measured = prefill_rate._prompts(300, 49152)
    warm_warmup, again = prefill_rate._prompts(300, 49152, warm_store=True)
    assert again == measured  # the measured ids are the same either way (and on llama-server)
    assert len(cold_warmup) == prefill_rate.WARMUP_TOKENS
    assert len(warm_warmup) == len(measured) == 300
    assert warm_warmup[0] != measured[0]  # the prefix cache can reuse none of it


def test_a_measurement_gives_the_same_first_token_cold_and_warm(tiny_model_path):
    cold = prefill_rate.measure(tiny_model_path, 300, 128, rows=2)
    warm = prefill_rate.measure(tiny_model_path, 300, 128, rows=2, warm_store=True)
    assert (cold["warm_store"], warm["warm_store"]) == (False, True)
    assert cold["tokens"] == warm["tokens"] == 300 and cold["seconds"] > 0
    assert cold["first_token"] == warm["first_token"] and len(cold["first_token"]) == 1
    # the rate is of the unrounded seconds (printed to the millisecond)
    assert abs(cold["prompt_tok_s"] * cold["seconds"] - 300) <= 300 * 0.001 / cold["seconds"]
