"""Two ranks on localhost (ring backend, CPU) serving the tiny checkpoint pipeline-parallel:
rank 0 runs layer 0, rank 1 layer 1, each with the KV of its own layer."""

from __future__ import annotations

import httpx
import pytest

from llm_server.engines.mlx.pipeline import stage_layers
from llm_server.testing.ranks import start_ranks
from tests.distributed.helpers import assert_answers_as_one_process, complete, model_id


@pytest.fixture(scope="module")
def stages(tiny_model_path, tmp_path_factory):
    args = ("--pipeline", "--concurrent-requests", "4", "--distributed-timeout", "5")
    group = start_ranks(tiny_model_path, tmp_path_factory.mktemp("stages"), 2, args)
    yield group
    group.stop()


def test_layers_split_in_order_low_ranks_first():
    assert stage_layers(5, 2) == [range(0, 3), range(3, 5)]
    assert stage_layers(4, 4) == [range(i, i + 1) for i in range(4)]
    with pytest.raises(ValueError, match="2 layers do not split over 3 pipeline ranks"):
        stage_layers(2, 3)


def test_a_stage_holds_only_its_layers(tiny_llama_path):
    """Built, not run: the split needs the group's rank and size only."""
    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings

    class Rank1Of2:
        def rank(self) -> int:
            return 1

        def size(self) -> int:
            return 2

    whole = MLXEngine(tiny_llama_path, EngineSettings(rows=1))
    stage = MLXEngine(
        tiny_llama_path, EngineSettings(rows=1, group=Rank1Of2(), parallel="pipeline")
    )
    assert stage.stage.layers == range(1, 2) and stage.stage.total == 2
    assert (whole.num_layers, stage.num_layers) == (2, 1)
    layer = whole.weight_bytes() - stage.weight_bytes()  # one layer's weights are not here
    assert 0 < layer < whole.weight_bytes() / 2
    assert stage.prefix_cache.enabled  # counted as the whole model's bytes (same on all ranks)


def test_every_served_family_splits(tiny_model_path, tiny_llama_path, tmp_path):
    """llama, qwen2 and qwen3 stages on two ranks give a whole engine's logits, for mixed
    steps, a prefix reused from a running row, and a scoring chunk (no HTTP: the engines)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from llm_server.testing.ranks import free_ports
    from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint

    qwen2 = build_tiny_checkpoint(tmp_path / "qwen2", TinySpec(arch="qwen2"))
    paths = [str(p) for p in (tiny_model_path, tiny_llama_path, qwen2)]
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    program = Path(__file__).with_name("stage_program.py")
    procs = [
        subprocess.Popen(
            [sys.executable, str(program), *paths],
            env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    lines = [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")]
    assert [line["model"] for line in lines] == paths, outs[0]
    for line in lines:
        assert line["max_diff"] < 1e-4, line


def test_other_families_and_a_lone_pipeline_flag_are_refused():
    from llm_server.cli import build_parser, validate_args
    from llm_server.engines.mlx.pipeline import refusal

    gemma = type("Model", (), {"__module__": "mlx_lm.models.gemma2"})()
    assert refusal(gemma) == (
        "--pipeline serves llama, qwen2, qwen3 models, not gemma2 "
        "(shard it tensor-parallel: leave out --pipeline)"
    )
    with pytest.raises(SystemExit, match="--pipeline needs --distributed BACKEND or --hosts"):
        validate_args(build_parser().parse_args(["--pipeline"]))


def test_a_follower_exits_when_rank_zero_is_killed(tiny_model_path, tmp_path):
    """Rank 0 killed after a request: rank 1's next collective fails (or, if the link stayed
    silent, its watchdog fires) and it exits with the group-lost status."""
    args = ("--pipeline", "--distributed-timeout", "5")
    group = start_ranks(tiny_model_path, tmp_path, 2, args)
    try:
        assert complete(group.url, ["Hello"], max_tokens=2)[0][1] == 2
        group.procs[0].kill()
        assert group.procs[1].wait(30) == 3, group.text()
    finally:
        group.stop()


def test_pipeline_ranks_answer_as_one_process(stages, live_server, tiny_model_path):
    alone = live_server(tiny_model_path, concurrent=4)
    health = assert_answers_as_one_process(stages.url, alone.url)
    dist = health["distributed"]
    assert (dist["backend"], dist["mode"], dist["ranks"], dist["lost"]) == (
        "ring",
        "pipeline",
        2,
        None,
    )
    # rank 0 is done with every call; rank 1 reported its count with the last broadcast
    assert dist["rank_steps"][0] == dist["steps"] > 0
    assert dist["steps"] - 1 <= dist["rank_steps"][1] <= dist["steps"]


def test_embeddings_are_refused_on_a_split_model(stages):
    body = {"model": model_id(stages.url), "input": "hi"}
    r = httpx.post(stages.url + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert "sharded" in r.json()["error"]["message"]


def test_a_follower_exits_when_rank_zero_hangs(stages):
    """Last in the file: it ends the module's group. Rank 0 is stopped (SIGSTOP: its sockets
    stay open, so no collective fails): rank 1 hears no call or heartbeat for twice
    --distributed-timeout (5 s) and exits with the group-lost status instead of waiting."""
    import signal

    stages.procs[0].send_signal(signal.SIGSTOP)
    try:
        assert stages.procs[1].wait(30) == 3, stages.text()
    finally:
        stages.procs[0].kill()
    assert "rank 1: nothing from rank 0 for 1" in stages.text()  # 10-11 s
