"""The compiled decode step: the same logits, bit for bit, and tokens as the eager step.

Both attend over the same span of each row's store with the same arithmetic
(decode_attention), and compiling changes no rounding on the CPU, so the logits are equal
exactly: across span and capacity boundaries, for subsets of rows, on another thread.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from llm_server.engines.kv.store import GROW
from llm_server.engines.mlx.engine import MLXEngine
from llm_server.engines.settings import EngineSettings
from llm_server.native.decode_attention import SPAN
from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint


@pytest.fixture(scope="module")
def qwen2_path(tmp_path_factory):
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny") / "tiny-qwen2", TinySpec(arch="qwen2")
    )


def _pair(path, rows: int) -> tuple[MLXEngine, MLXEngine]:
    compiled = MLXEngine(path, EngineSettings(rows=rows))  # on by default on the CPU
    eager = MLXEngine(path, EngineSettings(rows=rows, compiled_decode=False))
    assert compiled.fused is not None and compiled.fused.compiled is not None
    assert eager.fused.compiled is None
    return compiled, eager


def _run_steps(compiled, eager, row_sets, last, steps):
    """Alternate the row sets for `steps` decode steps on both engines; each step's logits
    equal bit for bit."""
    for step in range(steps):
        rows = row_sets[step % len(row_sets)]
        toks = [last[r] for r in rows]
        a, b = compiled.decode(rows, toks), eager.decode(rows, toks)
        np.testing.assert_array_equal(a, b)
        last.update(zip(rows, a.argmax(-1).tolist(), strict=True))


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen2"])
def test_compiled_steps_equal_eager_across_span_and_capacity(
    arch, tiny_model_path, tiny_llama_path, qwen2_path
):
    """Rows at different cursors, all rows and gathered subsets, across SPAN boundaries and the
    store's growth from GROW to 2 * GROW positions."""
    path = {"qwen3": tiny_model_path, "llama": tiny_llama_path, "qwen2": qwen2_path}[arch]
    compiled, eager = _pair(path, rows=4)
    rng = np.random.default_rng(11)
    last = {}
    for row, n in enumerate((GROW - 6, 3, SPAN - 2, 40)):  # row 0 crosses GROW during the run
        prompt = rng.integers(3, 380, n).tolist()
        a, b = compiled.prefill(row, prompt), eager.prefill(row, prompt)
        np.testing.assert_array_equal(a, b)  # prefill is not compiled: the same forward
        last[row] = int(np.argmax(a))
    assert compiled.row_table.store.capacity == GROW
    _run_steps(compiled, eager, [[0, 1, 2, 3], [0, 2], [3], [1, 2, 3]], last, steps=24)
    assert compiled.row_table.store.capacity == 2 * GROW  # the store grew under the compiled step
    assert [compiled.cursor(r) for r in range(4)] == [eager.cursor(r) for r in range(4)]
    assert compiled.cursor(0) > GROW and compiled.cursor(2) > SPAN
    # graphs per (rows, capacity, span, ...), not per step
    assert 4 <= compiled.fused.compiled.traces < 24


def test_a_released_row_and_a_new_prompt_reuse_the_graphs(tiny_llama_path):
    """Releasing and refilling rows (stale store contents past the new cursor) changes
    nothing: masked positions never leak into the result."""
    compiled, eager = _pair(tiny_llama_path, rows=2)
    rng = np.random.default_rng(2)
    last = {}
    for row in (0, 1):
        prompt = rng.integers(3, 380, 50).tolist()
        last[row] = int(np.argmax(compiled.prefill(row, prompt)))
        eager.prefill(row, prompt)
    _run_steps(compiled, eager, [[0, 1]], last, steps=4)
    for engine in (compiled, eager):
        engine.release(0)
    prompt = rng.integers(3, 380, 10).tolist()  # shorter: positions 10..53 hold old keys
    last[0] = int(np.argmax(compiled.prefill(0, prompt)))
    eager.prefill(0, prompt)
    traces = compiled.fused.compiled.traces
    _run_steps(compiled, eager, [[0, 1], [0]], last, steps=6)
    assert compiled.fused.compiled.traces <= traces + 1  # [0] alone is a new row count


def test_a_step_on_another_thread_equals_the_first_threads(tiny_llama_path):
    """The split streams belong to a thread: a new driving thread gets its own graph."""
    compiled, eager = _pair(tiny_llama_path, rows=1)
    prompt = list(range(5, 25))
    compiled.prefill(0, prompt)
    eager.prefill(0, prompt)
    first = compiled.decode([0], [7])
    results = {}

    def drive():
        results["a"] = compiled.decode([0], [9])
        compiled.thread_exit()

    thread = threading.Thread(target=drive)
    thread.start()
    thread.join()
    np.testing.assert_array_equal(first, eager.decode([0], [7]))
    np.testing.assert_array_equal(results["a"], eager.decode([0], [9]))


def test_a_dropped_engine_driven_from_two_threads_leaves_no_graph_behind(tmp_path):
    """MLX keys a compiled graph by its Python function's address, in a per-thread cache, and
    a dropped compiled function erases its entry only from the last calling thread's cache
    (mlx 0.32.4; ml-explore/mlx#3940). A step graph called from two threads and dropped left
    an entry behind, and a later graph at the reused address with the same input shapes got
    the dropped engine's tape: its weights. Each thread now has its own graphs.

    Engines of two checkpoints with the same shapes and other weights, the first driven from
    the main thread and a second thread, then dropped: the second's greedy tokens are its own.
    """
    import gc

    from llm_server.testing.families import build_family_checkpoint

    own, other = (build_family_checkpoint(tmp_path / f"s{s}", "llama", seed=s) for s in (0, 1))
    prompt = list(range(5, 25))

    def greedy(engine, n=4):
        logits, out = engine.prefill(0, prompt), []
        for _ in range(n):
            out.append(int(np.argmax(logits)))
            logits = engine.decode([0], [out[-1]])[0]
        return out

    expected = greedy(MLXEngine(own, EngineSettings(rows=1)))
    for _ in range(6):  # the address is reused nearly every time; six rounds make it certain
        dropped = MLXEngine(other, EngineSettings(rows=1))
        assert greedy(dropped) != expected  # the checkpoints answer differently
        thread = threading.Thread(target=lambda e=dropped: (greedy(e), e.thread_exit()))
        thread.start()
        thread.join()
        del dropped, thread
        gc.collect()
        assert greedy(MLXEngine(own, EngineSettings(rows=1))) == expected


@pytest.mark.slow
def test_smollm2_compiled_greedy_equals_eager(default_model_path):
    """SmolLM2: 40 steps on 3 rows at different cursors, across span boundaries and the store's
    growth past GROW positions; then a newcomer's chunk rides with the decoding rows and they
    get the logits of a compiled step."""
    from llm_server.engines.plan import DecodeRow, PrefillChunk, StepPlan

    compiled, eager = _pair(default_model_path, rows=4)
    rng = np.random.default_rng(0)
    last = {}
    for row, n in enumerate((GROW - 15, SPAN - 25, 5)):
        prompt = rng.integers(100, 40000, n).tolist()
        a, b = compiled.prefill(row, prompt), eager.prefill(row, prompt)
        np.testing.assert_array_equal(a, b)
        last[row] = int(np.argmax(a))
    _run_steps(compiled, eager, [[0, 1, 2], [1, 2]], last, steps=40)
    assert compiled.row_table.store.capacity == 2 * GROW and compiled.cursor(0) > GROW
    assert compiled.cursor(1) > SPAN
    tokens = [last[r] for r in range(3)]
    newcomer = rng.integers(100, 40000, 24).tolist()
    plan = StepPlan(
        decode=tuple(DecodeRow(r, t) for r, t in enumerate(tokens)),
        prefill=(PrefillChunk(1, 3, newcomer, 0, 24),),
    )
    mixed = eager.run(plan)  # the eager packed forward
    np.testing.assert_array_equal(mixed.logits[:3], compiled.decode([0, 1, 2], tokens))


@pytest.mark.slow
def test_smollm2_lone_row_equals_the_same_row_batched(default_model_path):
    """S10 on SmolLM2's dimensions: a request decoding alone gets the logits it gets beside
    two others and beside a 24-token prompt chunk, bit for bit. The skinny products give every
    output element one summation order whatever the rows beside it (with BLIS alone a 1-row
    product sums in another order: up to 5e-5 apart)."""
    from llm_server.engines.plan import DecodeRow, PrefillChunk, StepPlan
    from llm_server.native import skinny

    if not skinny.loaded():
        pytest.skip("needs the skinny products preloaded (Linux with a C compiler)")
    alone, batched = (
        MLXEngine(default_model_path, EngineSettings(rows=4)),
        MLXEngine(default_model_path, EngineSettings(rows=4)),
    )
    rng = np.random.default_rng(5)
    prompts = [rng.integers(100, 40000, n).tolist() for n in (70, 33, 120)]
    first = alone.prefill(0, prompts[0])
    np.testing.assert_array_equal(first, batched.prefill(0, prompts[0]))
    last = [int(np.argmax(batched.prefill(r, p))) for r, p in enumerate(prompts[1:], 1)]
    token = int(np.argmax(first))
    for step in range(6):
        lone = alone.decode([0], [token])
        if step % 2:  # beside two decoding rows
            both = batched.decode([0, 1, 2], [token, *last])
            last = both[1:].argmax(-1).tolist()
        else:  # beside two decoding rows and a newcomer's prompt chunk on row 3
            plan = StepPlan(
                decode=(DecodeRow(0, token), DecodeRow(1, last[0]), DecodeRow(2, last[1])),
                prefill=(PrefillChunk(10 + step, 3, rng.integers(100, 40000, 24).tolist(), 0, 24),),
            )
            both = batched.run(plan).logits[:3]
            batched.release(3)
            last = both[1:].argmax(-1).tolist()
        np.testing.assert_array_equal(lone, both[:1])
        token = int(np.argmax(lone))


def test_unsplit_steps_equal_eager(tiny_model_path):
    """Steps whose products are not split (BLIS threading, as without the thread setter): the
    same attention arithmetic, the same result bit for bit."""
    compiled, eager = _pair(tiny_model_path, rows=3)
    for engine in (compiled, eager):
        engine.fused.k.may_split = False
    rng = np.random.default_rng(4)
    last = {}
    for row, n in enumerate((SPAN + 5, 9, 30)):
        prompt = rng.integers(3, 380, n).tolist()
        last[row] = int(np.argmax(compiled.prefill(row, prompt)))
        eager.prefill(row, prompt)
    _run_steps(compiled, eager, [[0, 1, 2], [2, 0]], last, steps=6)


def test_steps_without_a_rope_table_equal_eager(tiny_model_path):
    """Metal has no cos/sin table (its rope kernel is fast): the compiled step then rotates
    with the model's rope module at per-row offsets; the same result."""
    from llm_server.engines.forward.compiled import CompiledSteps

    compiled, eager = _pair(tiny_model_path, rows=2)
    compiled.fused.use_table(None)
    eager.fused.use_table(None)
    compiled.fused.compiled = CompiledSteps(compiled.fused)
    assert compiled.fused.compiled.rotation is None
    rng = np.random.default_rng(6)
    last = {}
    for row, n in enumerate((12, 70)):
        prompt = rng.integers(3, 380, n).tolist()
        last[row] = int(np.argmax(compiled.prefill(row, prompt)))
        eager.prefill(row, prompt)
    _run_steps(compiled, eager, [[0, 1], [1]], last, steps=4)


def _plan(decode, chunks=()):
    from llm_server.engines.plan import StepPlan

    return StepPlan(decode=tuple(decode), prefill=tuple(chunks))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_mixed_steps_and_drafts_give_decode_rows_the_compiled_steps_logits(
    arch, tiny_model_path, tiny_llama_path
):
    """Decode rows riding with a newcomer's prompt chunk (the eager packed forward), and the
    positions of a draft being verified, get the logits of compiled pure decode steps bit for
    bit: rows at different cursors, one crossing a span boundary."""
    from llm_server.engines.plan import DecodeRow, PrefillChunk

    path = {"qwen3": tiny_model_path, "llama": tiny_llama_path}[arch]
    mixed = MLXEngine(path, EngineSettings(rows=4, prefix_cache_bytes=0))
    pure = MLXEngine(path, EngineSettings(rows=4, prefix_cache_bytes=0))
    rng = np.random.default_rng(3)
    last = []
    for row, n in enumerate((SPAN - 1, 10, 100)):
        prompt = rng.integers(3, 380, n).tolist()
        a = mixed.prefill(row, prompt)
        np.testing.assert_array_equal(a, pure.prefill(row, prompt))
        last.append(int(np.argmax(a)))
    newcomer = rng.integers(3, 380, 30).tolist()
    got = mixed.run(
        _plan([DecodeRow(r, t) for r, t in enumerate(last)], [PrefillChunk(1, 3, newcomer, 0, 20)])
    )
    want = pure.decode([0, 1, 2], last)
    assert got.rows == (0, 1, 2) and mixed.cursor(0) == SPAN  # row 0 now past the span
    np.testing.assert_array_equal(got.logits, want)
    pure.prefill(3, newcomer[:20])
    # row 0 verifies a draft of 3 ids beside row 1 and the rest of the newcomer's prompt
    nxt = want.argmax(-1).tolist()
    draft = rng.integers(3, 380, 3).tolist()
    got = mixed.run(
        _plan(
            [DecodeRow(0, nxt[0], tuple(draft)), DecodeRow(1, nxt[1])],
            [PrefillChunk(1, 3, newcomer, 20, 30)],
        )
    )
    np.testing.assert_array_equal(got.logits[:2], pure.decode([0, 1], nxt[:2]))
    for i, token in enumerate(draft):  # each verified position = a compiled decode step
        np.testing.assert_array_equal(got.verified[0][i], pure.decode([0, 2], [token, 5])[0])
    assert mixed.fused.compiled.traces == 0  # mixed steps run eagerly
    assert pure.fused.compiled.traces > 0


def test_staggered_requests_batched_equal_alone_with_compiled_steps(tiny_model_path):
    """Requests arriving while others decode (their prompt chunks riding in the decode
    forwards) produce the tokens each produces alone on an engine without compiled steps."""
    from llm_server.scheduler import BatchScheduler
    from llm_server.tokenizer import Tokenizer
    from tests.scheduler.helpers import make_request

    tok = Tokenizer(tiny_model_path)
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, 380, n).tolist() for n in (5, 23, 40, 61)]
    engines, mixed = [], []

    class Recorder(MLXEngine):
        def run(self, plan):
            mixed.append(bool(plan.decode and plan.prefill))
            return super().run(plan)

    def engine(rows, compiled):
        engines.append(
            Recorder(tiny_model_path, EngineSettings(rows=rows, compiled_decode=compiled))
        )
        return engines[-1]

    def serve(rows, compiled, batch):
        sched = BatchScheduler(
            lambda: engine(rows, compiled), max_concurrent=rows, step_tokens=16
        ).start()
        sched.wait_ready(60)
        outs = []
        try:
            for group in batch:
                for p in group:
                    req, out = make_request(tok, p, 24, ignore_eos=True)
                    sched.submit(req)
                    outs.append(out)
                while not all(o.tokens for o in outs) and not outs[-1].done.is_set():
                    outs[-1].done.wait(0.005)  # the next ones come while these decode
            assert all(o.done.wait(120) for o in outs)
            return [o.tokens for o in outs]
        finally:
            sched.close(10)

    batched = serve(4, True, [prompts[:1], prompts[1:3], prompts[3:]])
    assert engines[-1].fused.compiled.traces > 0
    assert sum(mixed) >= 3  # prompt chunks rode with decoding rows
    alone = [serve(1, False, [[p]])[0] for p in prompts]
    assert batched == alone


@pytest.mark.parametrize("flag, on", [([], True), (["--compiled-decode", "off"], False)])
def test_the_cli_flag_turns_compiled_steps_off(tiny_llama_path, flag, on):
    from llm_server.cli import build_parser
    from llm_server.server import make_service
    from llm_server.settings import ServerSettings

    svc = make_service(ServerSettings.from_args(build_parser().parse_args(flag)), tiny_llama_path)
    try:
        svc.wait_ready(120)
        assert (svc.engine.fused.compiled is not None) is on
    finally:
        svc.scheduler.abort()
        svc.close(30)


def test_whole_layer_steps_equal_separate_op_steps(tiny_llama_path):
    """Compiled steps that run each layer as the four whole-layer decode ops give the logits of
    compiled steps with the separate ops, bit for bit: rows at different cursors, subsets,
    across the store's growth."""
    from llm_server.native import skinny

    if not skinny.loaded():
        pytest.skip(
            "the skinny library is not preloaded (run under python -m llm_server.native.blas)"
        )
    whole, separate = (
        MLXEngine(tiny_llama_path, EngineSettings(rows=3)),
        MLXEngine(tiny_llama_path, EngineSettings(rows=3)),
    )
    assert whole.fused.k.whole_layers
    separate.fused.k.whole_layers = False  # read when a step's graph is traced
    rng = np.random.default_rng(4)
    last = {}
    for row, n in enumerate((GROW - 5, 2, 33)):
        prompt = rng.integers(3, 380, n).tolist()
        a, b = whole.prefill(row, prompt), separate.prefill(row, prompt)
        np.testing.assert_array_equal(a, b)
        last[row] = int(np.argmax(a))
    _run_steps(whole, separate, [[0, 1, 2], [2], [0, 2], [1]], last, steps=16)
    assert whole.row_table.store.capacity == 2 * GROW


def test_a_steps_attention_is_freed_without_the_collector(tiny_llama_path):
    """A compiled step's attention object (built while the step is traced, holding the
    trace's lists of every layer's keys and values) is freed as soon as the trace drops it,
    not when the garbage collector next runs: no reference cycle. One held the whole KV store
    (+46 MB on SmolLM2 at 4 rows) between collections."""
    import gc
    import weakref

    import mlx.core as mx

    from llm_server.engines.forward.compiled import StepShape

    engine = MLXEngine(tiny_llama_path, EngineSettings(rows=4))
    engine.prefill(0, [5, 9, 14, 3, 7])
    store = engine.row_table.store
    keys, values = list(store.keys), list(store.values)
    shape = StepShape(1, store.capacity, 64, 4, 0, False)
    context = engine.fused.k.context(1)
    pos, rows = mx.array([5], dtype=mx.int32), mx.array([0], dtype=mx.int32)
    gc.disable()
    try:
        attention = context.graph_attention(keys, values, pos, rows, shape)
        assert attention.whole_layer is None or callable(attention.whole_layer)
        freed = weakref.ref(attention)
        del attention
        assert freed() is None, gc.get_referrers(freed())
    finally:
        gc.enable()
