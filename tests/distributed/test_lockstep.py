"""The plan codec and the follower loop, without a group: a queue stands in for the ring."""

from __future__ import annotations

import numpy as np
import pytest

from llm_server.distributed import codec
from llm_server.distributed.codec import Call, Op
from llm_server.distributed.engine import GroupLost, LockstepEngine
from llm_server.distributed.follower import follow
from llm_server.distributed.transport import QueueTransport
from llm_server.engines.plan import DecodeRow, PrefillChunk, StepPlan


def roundtrip(call: Call) -> Call:
    header, payload = codec.encode(call)
    assert header.dtype == np.int32 and header.shape == (codec.HEADER,)
    assert payload.dtype == np.int32
    return codec.decode(header, payload)


def test_a_plan_survives_the_codec():
    plan = StepPlan(
        decode=(DecodeRow(row=0, token=17), DecodeRow(row=3, token=0)),
        prefill=(
            PrefillChunk(seq=9, row=1, prompt=(5, 6, 7, 8), start=0, end=2),
            PrefillChunk(seq=4, row=2, prompt=(1, 2, 3), start=2, end=3),
        ),
    )
    back = roundtrip(Call(Op.RUN, plan=plan))
    assert back.op is Op.RUN
    assert back.plan.decode == plan.decode
    assert back.plan.prefill == plan.prefill


def test_every_other_call_survives_the_codec():
    back = roundtrip(Call(Op.PREFILL, row=2, tokens=np.array([4, 5, 6])))
    assert (back.op, back.row, back.tokens.tolist()) == (Op.PREFILL, 2, [4, 5, 6])
    back = roundtrip(Call(Op.DECODE, rows=(0, 2), tokens=np.array([11, 12])))
    assert (back.rows, back.tokens.tolist()) == ((0, 2), [11, 12])
    assert roundtrip(Call(Op.RELEASE, row=3)).row == 3
    assert roundtrip(Call(Op.SCORE_BEGIN, value=5)).value == 5
    tokens, targets = np.arange(6).reshape(2, 3), np.arange(6, 12).reshape(2, 3)
    back = roundtrip(Call(Op.SCORE_CHUNK, tokens=tokens, targets=targets, value=2))
    assert back.tokens.tolist() == tokens.tolist() and back.targets.tolist() == targets.tolist()
    assert back.value == 2
    assert roundtrip(Call(Op.SCORE_END)).op is Op.SCORE_END
    assert roundtrip(Call(Op.STOP)).op is Op.STOP


def test_a_header_out_of_step_is_refused():
    header, payload = codec.encode(Call(Op.RELEASE, row=1))
    with pytest.raises(ValueError, match="out of step"):
        codec.decode(np.zeros_like(header), payload)
    with pytest.raises(ValueError, match="payload"):
        codec.decode(header, np.zeros(3, np.int32))


def test_the_follower_ends_where_rank_zero_does(tiny_model_path):
    """Rank 0's calls replayed by the follower loop leave its engine in the same state and
    with the same logits (two unsharded engines: the loop, not the sharding, is under test)."""
    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings

    def engine():
        return MLXEngine(
            tiny_model_path, EngineSettings(rows=2, fused_decode=False, prefix_cache_bytes=0)
        )

    transport = QueueTransport()
    local = engine()
    leader = LockstepEngine(local, transport, size=2, backend="queue")
    first = leader.run(
        StepPlan(prefill=(PrefillChunk(seq=1, row=0, prompt=(3, 4, 5, 6), start=0, end=2),))
    )
    assert first.rows == ()  # the prompt is half done: nothing to sample yet
    step = leader.run(
        StepPlan(prefill=(PrefillChunk(seq=1, row=0, prompt=(3, 4, 5, 6), start=2, end=4),))
    )
    tok = int(step.logits[0].argmax())
    leader.prefill(1, [7, 8, 9])
    leader.decode([0, 1], [tok, 10])
    leader.score_begin(1)
    scored = leader.score_chunk(np.array([[3, 4, 5]]), np.array([[4, 5, 6]]), 2)
    leader.score_end()
    leader.release(1)
    with pytest.raises(ValueError):
        leader.prefill(5, [1])  # no such row: raised on rank 0, and on the follower alike
    leader.stop()

    follower = engine()
    assert follow(follower, transport) == 9
    assert [follower.cursor(r) for r in (0, 1)] == [leader.cursor(0), leader.cursor(1)] == [5, 0]
    assert follower.row_table.tokens[0] == local.row_table.tokens[0] == [3, 4, 5, 6, tok]
    follower.score_begin(1)
    again = follower.score_chunk(np.array([[3, 4, 5]]), np.array([[4, 5, 6]]), 2)
    np.testing.assert_allclose(again.token_logprobs, scored.token_logprobs, atol=1e-6)


def test_a_lost_group_fails_every_call_at_once():
    class Dead:
        def send(self, header, payload):
            raise RuntimeError("[ring] connection to a peer was lost")

    class Engine:
        released: list[int] = []

        def run(self, plan):
            raise AssertionError("never reached: the send fails first")

        decode = run

        def release(self, row):
            self.released.append(row)
            raise RuntimeError("[ring] connection to a peer was lost")  # as mx.clear_cache does

    lost: list[str] = []
    leader = LockstepEngine(Engine(), Dead(), size=2, backend="ring")
    leader.on_lost = lambda reason, hung: lost.append(reason)
    with pytest.raises(GroupLost, match="the distributed group was lost: .*peer was lost"):
        leader.run(StepPlan(decode=(DecodeRow(0, 1),)))
    assert lost == [leader.lost]
    with pytest.raises(GroupLost):
        leader.decode([0], [1])
    leader.release(0)  # freed here only: nothing is sent to a dead group
    leader.stop()
    assert Engine.released == [0] and len(lost) == 1


def test_joining_without_a_launcher_is_one_clear_line(monkeypatch):
    from llm_server.distributed.launch import join

    monkeypatch.delenv("MLX_RANK", raising=False)
    monkeypatch.delenv("MLX_HOSTFILE", raising=False)
    with pytest.raises(SystemExit, match=r"--distributed ring: .*MLX_HOSTFILE.*mlx\.launch"):
        join("ring")
    with pytest.raises(SystemExit, match="--distributed bogus: .*valid values"):
        join("bogus")


def test_heads_that_do_not_split_over_the_ranks_are_refused(tmp_path):
    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.engines.settings import EngineSettings
    from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint

    class TwoRanks:  # refused before any collective: a stand-in group is enough
        def size(self) -> int:
            return 2

    path = build_tiny_checkpoint(tmp_path / "gqa1", TinySpec(num_kv_heads=1))
    with pytest.raises(ValueError, match="num_key_value_heads=1 does not split over 2 ranks"):
        MLXEngine(path, EngineSettings(rows=1, group=TwoRanks()))


def test_the_watchdog_marks_a_hung_call_lost():
    import threading

    from llm_server.distributed.launch import watch

    seen: list[tuple[str, bool]] = []
    called = threading.Event()

    class Transport:
        def send(self, header, payload):
            called.wait(30)  # the collective never returns while the watchdog looks
            return [0, 0]

    class Engine:
        def run(self, plan):
            raise AssertionError("ran after the hung send returned")

        decode = run

    leader = LockstepEngine(Engine(), Transport(), size=2, backend="ring")
    leader.on_lost = lambda reason, hung: (seen.append((reason, hung)), called.set())
    watch(leader, timeout=0.2)
    with pytest.raises(AssertionError):  # the transport returns once the watchdog fired
        leader.run(StepPlan(decode=(DecodeRow(0, 1),)))
    assert seen and seen[0][1] is True
    assert seen[0][0].startswith("the distributed group was lost: no answer for")
    with pytest.raises(GroupLost):
        leader.decode([0], [1])


def test_hosts_runs_the_same_command_under_mlx_launch(monkeypatch):
    import subprocess
    import sys
    from pathlib import Path

    from llm_server.distributed import launch

    ran: list[list[str]] = []
    monkeypatch.setattr(subprocess, "call", lambda cmd: ran.append(cmd) or 0)
    argv = ["--model", "M", "--hosts", "h.json", "--port", "9000", "--hosts=x.json"]
    assert launch.launch_hosts(argv, "h.json", "ring") == 0
    launcher = str(Path(sys.executable).with_name("mlx.launch"))
    assert launch.RANK_PROGRAM.read_text().count("from llm_server.cli import main") == 1
    assert ran == [
        [launcher, "--backend", "ring", "--hostfile", "h.json", "--python", sys.executable,
         str(launch.RANK_PROGRAM), "--model", "M", "--port", "9000", "--distributed", "ring"]
    ]  # fmt: skip


def test_an_idle_rank_zero_heartbeats_and_the_follower_does_not_count_them():
    class Engine:
        def __init__(self) -> None:
            self.released: list[int] = []

        def release(self, row: int) -> None:
            self.released.append(row)

    transport = QueueTransport()
    leader = LockstepEngine(Engine(), transport, size=2, backend="queue")
    assert leader.heartbeat(idle=60) is False  # something went out less than a minute ago
    assert leader.heartbeat(idle=0) is True
    leader.release(1)
    assert leader.heartbeat(idle=0) is True
    assert (leader.steps, leader.rank_steps[0]) == (1, 1)  # heartbeats are not calls
    leader.stop()
    follower = Engine()
    assert follow(follower, transport) == 1 and follower.released == [1]
    assert transport.completed == 1  # what the follower reported with its last receive


def test_a_follower_whose_rank_zero_is_silent_exits(monkeypatch):
    import threading

    from llm_server.distributed import launch
    from llm_server.distributed.follower import Heard

    exited: list[int] = []
    done = threading.Event()

    def fake_exit(code: int) -> None:
        exited.append(code)
        done.set()

    monkeypatch.setattr(launch.os, "_exit", fake_exit)
    heard = Heard()
    heard.now()
    heard.at -= 5  # rank 0 last spoke 5 s ago
    launch.watch_rank_zero(heard, silence=1.0, rank=1)
    assert done.wait(10) and exited == [launch.EXIT_GROUP_LOST]
