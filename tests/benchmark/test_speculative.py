"""llm-benchmark's edit workload and the speculative on/off benchmark (issue 19)."""

from __future__ import annotations

from llm_server.benchmark import speculative
from llm_server.benchmark.cli import build_parser, settings_from
from llm_server.benchmark.runner import load_prompts


def test_edit_workload_and_speculative_flag_reach_the_settings(tiny_model_path, tmp_path):
    args = build_parser().parse_args(
        ["--model", str(tiny_model_path), "--out", str(tmp_path), "--workload", "edit",
         "--speculative", "off"]
    )  # fmt: skip
    s = settings_from(args)
    assert (s.workload, s.speculative) == ("edit", "off")
    prompts = load_prompts("edit")
    assert [p.id for p in prompts] == [f"edit-{i}" for i in range(len(speculative.EDIT_PASSAGES))]
    for p, (task, passage) in zip(prompts, speculative.EDIT_PASSAGES, strict=True):
        assert p.messages == [{"role": "user", "content": f"{task}:\n\n{passage}"}]
    assert len(load_prompts()) == 32  # chat stays the default


def test_speculative_benchmark_gives_the_same_tokens_on_and_off(tiny_model_path):
    prompts = speculative.edit_messages()[:2]
    off, _, drafted_off, _, _ = speculative.run(tiny_model_path, prompts, 2, "off", 16, 4)
    on, _, drafted, accepted, fit = speculative.run(tiny_model_path, prompts, 2, "ngram", 16, 4)
    assert on == off and all(len(t) > 0 for t in on)
    assert drafted_off == 0 and drafted > 0 and 0 <= accepted <= drafted
    # the run reports the spec policy's fit (ms) and its counts
    assert sorted(fit["fit_ms"]) == ["a", "c", "d", "r"] and fit["fit_ms"]["a"] > 0
    assert (fit["drafted"], fit["accepted"]) == (drafted, accepted) and fit["sources"]
