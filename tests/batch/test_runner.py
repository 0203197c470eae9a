"""The runner's state machine over a real store, with the app call replaced: transitions and
their log lines, lines answered 429/503 run again, expiry, a restart mid-batch."""

from __future__ import annotations

import asyncio
import json
import logging

from llm_server.batch.runner import BatchRunner
from llm_server.batch.store import BatchStore


def _content(n: int) -> bytes:
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": str(i)},
        }
        for i in range(n)
    ]
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def _runner(store: BatchStore, call, room: int = 4) -> BatchRunner:
    return BatchRunner(store, call, lambda model: room)


async def _until(runner: BatchRunner, batch_id: str, timeout: float = 10.0) -> dict:
    for _ in range(int(timeout / 0.01)):
        batch = runner.get(batch_id)
        if batch["status"] in ("completed", "failed", "cancelled", "expired"):
            return batch
        await asyncio.sleep(0.01)
    raise AssertionError(runner.get(batch_id))


def test_transitions_logged_and_busy_answers_retried(tmp_path, caplog):
    store = BatchStore(tmp_path)
    calls: dict[str, int] = {}

    async def call(path: str, body: dict) -> tuple[int, dict]:
        calls[body["prompt"]] = calls.get(body["prompt"], 0) + 1
        if body["prompt"] == "1" and calls["1"] < 3:
            return 503, {"error": {"message": "loading"}}  # not an answer: runs again
        if body["prompt"] == "2":
            return 400, {"error": {"message": "bad"}}
        return 200, {"text": body["prompt"], "usage": {"completion_tokens": 2}}

    async def main() -> dict:
        runner = _runner(store, call)
        runner.ensure_started()
        file = store.add_file(_content(4), "in.jsonl", "batch")
        batch = runner.create(file["id"], "/v1/completions", "24h", {"k": "v"})
        done = await _until(runner, batch["id"])
        await runner.stop()
        return done

    with caplog.at_level(logging.INFO, logger="llm_server.batch.runner"):
        done = asyncio.run(main())
    assert done["status"] == "completed" and done["metadata"] == {"k": "v"}
    assert done["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    assert calls == {"0": 1, "1": 3, "2": 1, "3": 1}
    changes = [r.getMessage().split(": ", 1)[1].split(" (")[0] for r in caplog.records]
    assert changes[1:] == [
        "validating -> in_progress",
        "in_progress -> finalizing",
        "finalizing -> completed",
    ]
    errors = store.file_content(done["error_file_id"]).decode().splitlines()
    assert [json.loads(e)["custom_id"] for e in errors] == ["c2"]


def test_a_batch_past_its_window_expires_with_its_lines_in_the_error_file(tmp_path):
    store = BatchStore(tmp_path)

    async def call(path: str, body: dict) -> tuple[int, dict]:
        return 200, {}

    async def main() -> dict:
        runner = _runner(store, call, room=0)  # no row ever frees: nothing runs
        file = store.add_file(_content(3), "in.jsonl", "batch")
        batch = runner.create(file["id"], "/v1/completions", "24h", None)
        batch["expires_at"] = 0  # the window is over
        store.save_batch(batch)
        runner.ensure_started()
        done = await _until(runner, batch["id"])
        await runner.stop()
        return done

    done = asyncio.run(main())
    assert done["status"] == "expired" and done["expired_at"]
    assert done["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    lines = [json.loads(x) for x in store.file_content(done["error_file_id"]).splitlines()]
    assert {x["error"]["code"] for x in lines} == {"batch_expired"}


def test_a_restarted_runner_resumes_and_runs_only_what_is_missing(tmp_path):
    started: list[str] = []

    async def slow(path: str, body: dict) -> tuple[int, dict]:
        started.append(body["prompt"])
        await asyncio.sleep(0 if body["prompt"] in ("0", "1") else 60)
        return 200, {}

    async def first() -> str:
        store = BatchStore(tmp_path)
        runner = _runner(store, slow, room=3)
        runner.ensure_started()
        file = store.add_file(_content(5), "in.jsonl", "batch")
        batch_id = runner.create(file["id"], "/v1/completions", "24h", None)["id"]
        while len(store.results(batch_id).lines) < 2:
            await asyncio.sleep(0.01)
        await runner.stop()  # the process ends; lines 2 and 3 were running
        store.close()
        return batch_id

    batch_id = asyncio.run(first())
    again: list[str] = []

    async def quick(path: str, body: dict) -> tuple[int, dict]:
        again.append(body["prompt"])
        return 200, {}

    async def second() -> dict:
        runner = _runner(BatchStore(tmp_path), quick)
        runner.ensure_started()
        done = await _until(runner, batch_id)
        await runner.stop()
        return done

    done = asyncio.run(second())
    assert done["status"] == "completed" and done["request_counts"]["completed"] == 5
    assert sorted(again) == ["2", "3", "4"]


def test_a_cancel_while_validating_ends_cancelled(tmp_path):
    store = BatchStore(tmp_path)

    async def call(path: str, body: dict) -> tuple[int, dict]:
        await asyncio.sleep(60)
        return 200, {}

    async def main() -> dict:
        runner = _runner(store, call)
        file = store.add_file(_content(3), "in.jsonl", "batch")
        batch = runner.create(file["id"], "/v1/completions", "24h", None)
        runner.ensure_started()
        runner.cancel(batch["id"])
        done = await _until(runner, batch["id"])
        await runner.stop()
        return done

    done = asyncio.run(main())
    assert done["status"] == "cancelled" and done["cancelled_at"]
    assert done["request_counts"]["completed"] == 0 and done["output_file_id"] is None
