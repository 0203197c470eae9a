"""benchmark.turn_cost: the ids each server is sent, the table, and a real run of ours."""

from __future__ import annotations

import json

import pytest

from llm_server.benchmark.turn_cost import arithmetic_floor, countable, main, markdown, turns


def test_each_turn_resends_the_history_grown_by_new_ids_then_new_ids_alone():
    sent: list[tuple[list[int], bool]] = []

    def send(ids, cache):
        sent.append((ids, cache))
        return 0.5 if len(ids) > 50 else 0.25, len(ids) - 5 if cache else 0

    rows = turns(send, cached=100, new=10, count=2, vocab=800)
    warm, cold, turn2, alone2, back2, turn3, alone3, back3 = sent
    assert len(warm[0]) == 64 and not warm[1]
    assert len(cold[0]) == 100 and cold[1]
    assert turn2 == (cold[0] + turn2[0][100:], True) and len(turn2[0]) == 110
    assert len(alone2[0]) == 10 and not alone2[1] and alone2[0] != turn2[0][100:]
    assert back2 == turn2  # the conversation back in the cache before it grows again
    assert turn3[0][:110] == turn2[0] and len(turn3[0]) == 120 and back3 == turn3
    assert len(alone3[0]) == 10
    assert all(100 <= i < 800 for ids, _ in sent for i in ids)
    assert rows == [
        {"turn": 1, "prompt": 100, "cached": 95, "turn_s": 0.5},
        {"turn": 2, "prompt": 110, "cached": 105, "turn_s": 0.5, "alone_s": 0.25, "ratio": 2.0},
        {"turn": 3, "prompt": 120, "cached": 115, "turn_s": 0.5, "alone_s": 0.25, "ratio": 2.0},
    ]
    again: list = []
    turns(lambda ids, cache: (again.append(ids), (1.0, 0))[1], 100, 10, 2, 800)
    assert again == [ids for ids, _ in sent]  # every server gets the same ids


def test_the_table_puts_servers_side_by_side_per_turn():
    ours = [
        {"turn": 1, "prompt": 100, "cached": 0, "turn_s": 2.0},
        {"turn": 2, "prompt": 110, "cached": 100, "turn_s": 0.3, "alone_s": 0.1, "ratio": 3.0},
        {"turn": 3, "prompt": 120, "cached": 110, "turn_s": 0.5, "alone_s": 0.1, "ratio": 5.0},
    ]
    peer = [dict(r, turn_s=r["turn_s"] * 2) for r in ours]
    text = markdown({"ours": ours, "llama-server": peer}, 100, 10)
    assert "| 2 | 110 | 100 | 0.300 | 0.100 | 3.00 | 100 | 0.600 | 0.100 | 3.00 |" in text
    assert "| 3 | 120 | 110 | 0.500 | 0.100 | 5.00 | 110 | 1.000 | 0.100 | 5.00 |" in text
    assert "| 1 |" not in text  # the cold turn has no alone time to compare
    assert "ours: median turn 0.400 s, median ratio 4.00" in text


SMOLLM2 = {"hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "intermediate_size": 1536, "vocab_size": 49152}  # fmt: skip


def test_the_floor_is_the_turns_arithmetic_over_the_new_tokens_alone():
    # SmolLM2, 20 tokens: products 20 x 30 x 3,538,944; attention 20 x 3,710.5 pairs over
    # 3,700 cached (10.5 alone) x 30 x 2 x 9 x 64; the head 576 x 49,152 once
    products, attend, head = 20 * 30 * 3_538_944, 30 * 2 * 9 * 64, 576 * 49152
    want = (products + 74_210 * attend + head) / (products + 210 * attend + head)
    assert arithmetic_floor(SMOLLM2, 3700, 20) == pytest.approx(want, rel=1e-12)
    assert 2.15 < want < 2.2  # the attention over 3.7k outweighs the 20 tokens' products
    assert arithmetic_floor(SMOLLM2, 0, 20) == 1.0
    # a 7B llama shape: the same turn is dominated by its products
    llama7b = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "intermediate_size": 11008, "vocab_size": 32000}  # fmt: skip
    assert 1.13 < arithmetic_floor(llama7b, 3700, 20) < 1.16
    assert countable(llama7b) is llama7b
    assert countable({"text_config": SMOLLM2}) is None  # a config it cannot count: no floor


def test_the_table_shows_each_turns_floor_and_the_ratio_over_it():
    rows = [
        {"turn": 1, "prompt": 3700, "cached": 0, "turn_s": 9.0},
        {"turn": 2, "prompt": 3720, "cached": 3700, "turn_s": 0.3, "alone_s": 0.1, "ratio": 3.0},
    ]
    text = markdown({"ours": rows}, 3700, 20, SMOLLM2)
    floor = arithmetic_floor(SMOLLM2, 3700, 20)
    assert f"| 2 | 3720 | 3700 | 0.300 | 0.100 | 3.00 | {floor:.2f} |" in text
    assert f"ours: median turn 0.300 s, median ratio 3.00, over floor {3.0 / floor:.2f}" in text


@pytest.mark.timeout(240)
def test_a_run_of_ours_reuses_each_turns_prefix(tiny_model_path, tmp_path):
    out = tmp_path / "out"
    args = ["--model", str(tiny_model_path), "--cached", "96", "--new", "8", "--turns", "2"]
    assert main([*args, "--out", str(out)]) == 0
    rows = json.loads((out / "turn_cost.json").read_text())["ours"]
    assert [(r["turn"], r["prompt"]) for r in rows] == [(1, 96), (2, 104), (3, 112)]
    assert rows[0]["cached"] == 0
    # each turn reuses all of the previous turn's prompt but at most its last token
    assert rows[1]["cached"] >= 95 and rows[2]["cached"] >= 103
    assert all(r["turn_s"] > 0 and r["alone_s"] > 0 for r in rows[1:])
    assert "| 2 | 104 |" in (out / "turn_cost.md").read_text()
