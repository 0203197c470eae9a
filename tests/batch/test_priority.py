"""Batch lines run at the lowest priority (S11): behind every interactive request in the queue,
and outside --max-queued."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx

from llm_server.decoding import SamplingParams
from llm_server.scheduler import Priority, QueueFull
from llm_server.service import request_priority
from tests.batch.conftest import chat_line, jsonl, submit, wait_for


def test_batch_lines_queue_behind_interactive_and_outside_max_queued(tiny_model_path):
    from llm_server.testing.live import tiny_service

    svc = tiny_service(tiny_model_path, concurrent=1, max_queued=0)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    prompt = svc.tokenizer.encode("Hello there")

    async def run() -> list[int]:
        token = request_priority.set(Priority.BATCH)
        batch = [svc.start_generation(prompt, params) for _ in range(3)]  # 1 row, no queue
        request_priority.reset(token)
        interactive = svc.start_generation(prompt, params)
        try:
            svc.start_generation(prompt, params)
            raise AssertionError("a second interactive request found room")
        except QueueFull:
            pass
        for handle in [*batch, interactive]:
            async for _ in handle.events():
                pass
        seqs = [h.request.seq for h in batch]
        order = [s for s in svc.scheduler.admitted if s in {*seqs, interactive.request.seq}]
        assert all(h.request.priority is Priority.BATCH for h in batch)
        assert interactive.request.priority is Priority.INTERACTIVE
        return [order.index(s) for s in (*seqs, interactive.request.seq)]

    try:
        *batch_pos, interactive_pos = asyncio.run(run())
    finally:
        svc.close(30)
    # at most the one line already on the row ran before the interactive request
    assert sum(p < interactive_pos for p in batch_pos) <= 1


def test_interactive_requests_get_answers_while_a_batch_runs(client, batch_server):
    """4 rows, --max-queued 2: six interactive requests at once all get 200 while a batch
    holds rows (its lines do not fill the queue)."""
    lines = [chat_line(f"r{i}", "Hello", max_tokens=64) for i in range(30)]
    batch = submit(client, jsonl(lines))
    while client.batches.retrieve(batch.id).request_counts.completed < 1:
        pass

    def ask(i: int) -> int:
        body = {"messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 8}
        return httpx.post(
            batch_server.url + "/v1/chat/completions", json=body, timeout=60
        ).status_code

    with ThreadPoolExecutor(6) as pool:
        statuses = list(pool.map(ask, range(6)))
    assert statuses == [200] * 6
    done = wait_for(client, batch.id)
    assert done.status == "completed" and done.request_counts.completed == 30


def test_an_interactive_request_takes_a_batch_lines_row_and_the_line_resumes_unchanged(
    tiny_model_path,
):
    """One row: a batch line decoding gives its row to an interactive request at the next step
    boundary, then resumes (its output re-fed as prompt) with the same greedy tokens."""
    from llm_server.testing.live import tiny_service

    svc = tiny_service(tiny_model_path, concurrent=1, max_queued=0)
    line = SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    quick = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = svc.tokenizer.encode("Hello there")

    async def tokens(handle) -> list[int]:
        return [ev.token_id async for ev in handle.events() if hasattr(ev, "token_id")]

    async def run():
        token = request_priority.set(Priority.BATCH)
        alone = await tokens(svc.start_generation(prompt, line))
        batch = svc.start_generation(prompt, line)
        request_priority.reset(token)
        got, order = [], []
        async for ev in batch.events():
            if hasattr(ev, "token_id"):
                got.append(ev.token_id)
            if len(got) == 5:
                interactive = svc.start_generation(prompt, quick)
                task = asyncio.ensure_future(tokens(interactive))
                task.add_done_callback(lambda _: order.append(("interactive", len(got))))
        order.append(("batch", len(got)))
        await task
        return alone, got, order, batch.finish, interactive.finish

    try:
        alone, got, order, finish, quick_finish = asyncio.run(run())
    finally:
        svc.close(30)
    assert svc.scheduler.preempted >= 1
    assert order[0][0] == "interactive" and order[0][1] < 300  # done while the line ran
    assert got == alone  # the resumed line's greedy tokens are the uninterrupted ones
    assert finish.prompt_tokens == len(prompt) and finish.completion_tokens == 300
    assert quick_finish.completion_tokens == 4


def test_batch_lines_yield_every_row_while_an_interactive_request_runs(tiny_model_path):
    """The default (no --batch-share): no forward carries a batch line beside an interactive
    request; the lines resume after it and finish with their uninterrupted tokens."""
    from llm_server.testing.live import tiny_service

    svc = tiny_service(tiny_model_path, concurrent=4, max_queued=0)
    line = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    quick = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    prompts = [svc.tokenizer.encode(f"Line {i} says") for i in range(4)]

    async def tokens(handle) -> list[int]:
        return [ev.token_id async for ev in handle.events() if hasattr(ev, "token_id")]

    async def run():
        token = request_priority.set(Priority.BATCH)
        alone = [await tokens(svc.start_generation(p, line)) for p in prompts[:2]]
        lines = [svc.start_generation(p, line) for p in prompts[:2]]
        request_priority.reset(token)
        first = await lines[0]._queue.get()  # the lines are decoding
        svc.scheduler.step_trace = []
        interactive = svc.start_generation(svc.tokenizer.encode("Quick"), quick)
        quick_tokens = await tokens(interactive)
        got = [[first.token_id, *await tokens(lines[0])], await tokens(lines[1])]
        return alone, got, quick_tokens, interactive.request.seq, {h.request.seq for h in lines}

    try:
        alone, got, quick_tokens, seq, line_seqs = asyncio.run(run())
        trace = svc.scheduler.step_trace
    finally:
        svc.close(30)
    assert len(quick_tokens) == 20
    with_interactive = [step for step in trace if seq in step]
    assert with_interactive and not any(set(step) & line_seqs for step in with_interactive)
    assert got == alone
