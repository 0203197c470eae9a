"""The Batch API's runner: one task on the event loop takes batches oldest first, runs their
lines through the app's own route handlers at batch priority, and keeps the results on disk.

A batch goes validating -> in_progress -> finalizing -> completed (or failed at validation;
cancelling -> cancelled; expired past its completion window). Lines are handed to the app only
while `room(model)` says a row is free for them: no interactive request waits, and one row is
left for the next one (S11). A line answered 429/503 (full, loading, shutting down) is not an
answer: it runs again later. Every other answer is the line's, written once (store.Results).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from llm_server.batch.asgi import AppCall
from llm_server.batch.lines import ENDPOINTS, BatchLine, InputFileError, LineError, parse_input
from llm_server.batch.store import BatchStore, new_id
from llm_server.scheduler import Priority
from llm_server.service import request_priority

log = logging.getLogger(__name__)

COMPLETION_WINDOW = "24h"
WINDOW_SECONDS = 24 * 3600
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
RETRY_STATUSES = (429, 503)  # the server could not take the line now: not the line's answer
RETRY_DELAY_S = 0.5
POLL_S = 0.02  # how often a waiting runner looks for a free row again
SAVE_EVERY_S = 1.0  # request_counts on disk lag the results by at most this (GET reads live)


class BatchNotFound(LookupError):
    """No batch or file by that id (HTTP 404)."""


@dataclass
class Progress:
    """A running batch's progress, for GET /v1/batches/{id} and /metrics."""

    batch_id: str
    total: int
    done: int
    tokens: int = 0  # completion tokens of the lines finished since the runner took it
    lines_run: int = 0  # lines finished since then
    started: float = 0.0  # time.monotonic() when the runner took it

    def tokens_per_second(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.tokens / elapsed if elapsed > 0 else 0.0

    def eta_seconds(self) -> float | None:
        if not self.lines_run:
            return None
        per_line = (time.monotonic() - self.started) / self.lines_run
        return round(per_line * (self.total - self.done), 1)

    def as_json(self) -> dict:
        return {
            "lines_done": self.done,
            "lines_total": self.total,
            "tokens_per_second": round(self.tokens_per_second(), 2),
            "eta_seconds": self.eta_seconds(),
        }


class BatchRunner:
    """Creates, cancels and runs batches over `store`; `call` sends a line to the app and
    `room(model)` says how many lines for `model` may be in the app now."""

    def __init__(self, store: BatchStore, call: AppCall, room: Callable[[str | None], int]) -> None:
        self.store = store
        self._call = call
        self._room = room
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.progress: Progress | None = None
        self._cancelled: set[str] = set()  # batch ids asked to cancel while they run
        self.finished_lines = 0  # lines answered since start (all batches; /metrics)

    # -- the API's calls ----------------------------------------------------------------

    def ensure_started(self) -> None:
        """Start the task on the running loop (idempotent; again after its loop ended)."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._main())

    async def stop(self) -> None:
        """End the task (shutdown); lines in flight are not written and run after a restart."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._task = None

    def create(self, input_file_id: str, endpoint: str, window: str, metadata: dict | None) -> dict:
        """A new batch in `validating` (ValueError: a bad field; BatchNotFound: no such file)."""
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}; got {endpoint!r}")
        if window != COMPLETION_WINDOW:
            raise ValueError(f"completion_window must be {COMPLETION_WINDOW!r}; got {window!r}")
        file = self.store.file(input_file_id)
        if file is None:
            raise BatchNotFound(f"no file {input_file_id!r}")
        if file["purpose"] != "batch":
            raise ValueError(f"file {input_file_id!r} has purpose {file['purpose']!r}, not 'batch'")
        now = int(time.time())
        batch = {
            "id": new_id("batch_"),
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": input_file_id,
            "completion_window": window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + WINDOW_SECONDS,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
        }
        self.store.save_batch(batch)
        log.info("batch %s: created (%s, file %s)", batch["id"], endpoint, input_file_id)
        self._wake.set()
        return batch

    def get(self, batch_id: str) -> dict:
        batch = self.store.batch(batch_id)
        if batch is None:
            raise BatchNotFound(f"no batch {batch_id!r}")
        progress = self.progress
        if progress is not None and progress.batch_id == batch_id:
            batch["progress"] = progress.as_json()
            if batch["status"] == "in_progress":  # the counts on disk lag (SAVE_EVERY_S)
                lines = self.store.results(batch_id).lines
                batch["request_counts"] = _counts(lines, batch["request_counts"]["total"])
        return batch

    def cancel(self, batch_id: str) -> dict:
        """Ask to cancel; the runner stops its lines and finalizes (ValueError: finished)."""
        batch = self.get(batch_id)
        if batch["status"] in ("cancelling", "cancelled"):
            return batch
        if batch["status"] not in ("validating", "in_progress"):
            raise ValueError(f"batch {batch_id} is {batch['status']}; it cannot be cancelled")
        batch.pop("progress", None)
        self._cancelled.add(batch_id)
        self._transition(batch, "cancelling")
        self._wake.set()
        return batch

    # -- the task -----------------------------------------------------------------------

    async def _main(self) -> None:
        while True:
            active = [b for b in self.store.batches() if b["status"] in ACTIVE]
            if not active:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 1.0)
                continue
            try:
                await self._run(active[-1])  # the oldest
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a bug must not stop the other batches forever
                log.exception("batch %s: runner error; retrying", active[-1]["id"])
                await asyncio.sleep(1.0)

    async def _run(self, batch: dict) -> None:
        # reading, checking and writing whole files (up to --max-file-size) off the event loop
        if batch["status"] == "validating":
            lines = await asyncio.to_thread(self._validate, batch)
            if lines is None:
                return
        else:
            lines = await asyncio.to_thread(self._lines, batch)
        if batch["status"] == "in_progress":
            await self._run_lines(batch, lines)
        await asyncio.to_thread(self._finalize, self.store.batch(batch["id"]) or batch, lines)

    def _lines(self, batch: dict) -> list[BatchLine]:
        content = self.store.file_content(batch["input_file_id"]) or b""
        try:
            return parse_input(content, batch["endpoint"])
        except InputFileError:
            return []

    def _validate(self, batch: dict) -> list[BatchLine] | None:
        content = self.store.file_content(batch["input_file_id"])
        try:
            if content is None:
                raise InputFileError("file_not_found", "the input file was deleted")
            lines = parse_input(content, batch["endpoint"])
        except InputFileError as exc:
            batch["errors"] = {"object": "list", "data": [exc.as_error()]}
            self._transition(batch, "failed")
            return None
        batch["request_counts"] = {"total": len(lines), "completed": 0, "failed": 0}
        self._transition(batch, "in_progress")
        return lines

    async def _run_lines(self, batch: dict, lines: list[BatchLine]) -> None:
        """Run every line not yet in the results, while rows are free for them; return when
        all are in, or on cancel or expiry (what is running then is dropped, not written)."""
        results = self.store.results(batch["id"])
        batch_id = batch["id"]
        refused = [x for x in lines if x.error is not None and x.index not in results.lines]
        for line in refused:
            await asyncio.to_thread(results.add, line.index, _error_line(batch_id, line))
        pending = collections.deque(
            line for line in lines if line.error is None and line.index not in results.lines
        )
        self.progress = Progress(batch_id, len(lines), len(results.lines), started=time.monotonic())
        running: set[asyncio.Task] = set()
        saved = time.monotonic()
        try:
            while pending or running:
                if self._stopped(batch):
                    return
                while pending and len(running) < self._room(pending[0].body.get("model")):
                    line = pending.popleft()
                    task = self._run_line(batch_id, batch["endpoint"], line, pending)
                    running.add(asyncio.create_task(task))
                if running:
                    done, running = await asyncio.wait(
                        running, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED
                    )
                    running = set(running)
                    for task in done:
                        task.result()  # a bug in _run_line surfaces here
                else:
                    await asyncio.sleep(POLL_S)
                if time.monotonic() - saved > SAVE_EVERY_S:
                    self._save_counts(batch_id)
                    saved = time.monotonic()
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            self._save_counts(batch_id)

    async def _run_line(
        self, batch_id: str, endpoint: str, line: BatchLine, pending: collections.deque
    ) -> None:
        request_priority.set(Priority.BATCH)  # this task's context only
        try:
            status, answer = await self._call(endpoint, line.body)
        except Exception as exc:  # noqa: BLE001 - the line's error, not the runner's
            log.exception("batch %s: line %d failed", batch_id, line.index)
            status, answer = 500, {"error": {"message": str(exc), "type": "server_error"}}
        if status in RETRY_STATUSES:
            await asyncio.sleep(RETRY_DELAY_S)
            pending.appendleft(line)
            return
        output = _output_line(batch_id, line, status, answer)
        if await asyncio.to_thread(self.store.results(batch_id).add, line.index, output):
            self.finished_lines += 1
            progress = self.progress
            if progress is not None and progress.batch_id == batch_id:
                progress.done += 1
                progress.lines_run += 1
                progress.tokens += _completion_tokens(answer)

    def _stopped(self, batch: dict) -> bool:
        """Cancelled (cancelling) or past its window (_finalize then expires it)."""
        return batch["id"] in self._cancelled or time.time() > batch["expires_at"]

    def _save_counts(self, batch_id: str) -> None:
        batch = self.store.batch(batch_id)
        if batch is None:
            return
        counts = _counts(self.store.results(batch_id).lines, batch["request_counts"]["total"])
        if counts != batch["request_counts"]:
            batch["request_counts"] = counts
            self.store.save_batch(batch)

    def _finalize(self, batch: dict, lines: list[BatchLine]) -> None:
        """Write the output and error files from the results (again after a crash: same ids)."""
        status = batch["status"]
        if status in ("completed", "failed", "cancelled", "expired"):
            return
        if batch["id"] in self._cancelled and status == "in_progress":
            status = "cancelling"  # asked while validating: the validation wrote over it
            self._transition(batch, status)
        results = self.store.results(batch["id"]).lines
        left = [line for line in lines if line.index not in results]
        end = {"in_progress": "completed", "finalizing": "completed", "cancelling": "cancelled"}
        final = end[status]
        if status == "in_progress" and left and time.time() > batch["expires_at"]:
            final = "expired"  # the lines left fail; the status changes once they are written
            for line in left:
                expired = BatchLine(line.index, line.custom_id, None, _EXPIRED)
                self.store.results(batch["id"]).add(line.index, _error_line(batch["id"], expired))
        elif status == "in_progress":
            self._transition(batch, "finalizing")
        ok = [results[i] for i in sorted(results) if _succeeded(results[i])]
        failed = [results[i] for i in sorted(results) if not _succeeded(results[i])]
        hexid = batch["id"].removeprefix("batch_")
        for key, kind, out in (
            ("output_file_id", "output", ok),
            ("error_file_id", "error", failed),
        ):
            if out:
                content = "".join(_json_line(o) for o in out).encode("utf-8")
                name = f"{batch['id']}_{kind}.jsonl"
                file = self.store.add_file(content, name, f"batch_{kind}", f"file-{hexid}{kind}")
                batch[key] = file["id"]
        batch["request_counts"] = _counts(results, batch["request_counts"]["total"])
        if self.progress is not None and self.progress.batch_id == batch["id"]:
            self.progress = None
        self._cancelled.discard(batch["id"])
        self._transition(batch, final)
        self.store.close_results(batch["id"])

    def _transition(self, batch: dict, status: str) -> None:
        """Set `status` with its timestamp, save, and log the change."""
        before = batch["status"]
        batch["status"] = status
        stamp = f"{status}_at"
        if stamp in batch and batch[stamp] is None:
            batch[stamp] = int(time.time())
        self.store.save_batch(batch)
        counts = batch["request_counts"]
        log.info(
            "batch %s: %s -> %s (%d of %d lines done, %d failed)",
            batch["id"],
            before,
            status,
            counts["completed"] + counts["failed"],
            counts["total"],
            counts["failed"],
        )


_EXPIRED = LineError("batch_expired", "the batch's completion window ended before this line ran")


def _output_line(batch_id: str, line: BatchLine, status: int, answer: dict) -> dict:
    return {
        "id": f"batch_req_{batch_id.removeprefix('batch_')}_{line.index}",
        "custom_id": line.custom_id,
        "response": {
            "status_code": status,
            "request_id": f"req_{batch_id.removeprefix('batch_')}_{line.index}",
            "body": answer,
        },
        "error": None,
    }


def _error_line(batch_id: str, line: BatchLine) -> dict:
    return {
        "id": f"batch_req_{batch_id.removeprefix('batch_')}_{line.index}",
        "custom_id": line.custom_id,
        "response": None,
        "error": {"code": line.error.code, "message": line.error.message} if line.error else None,
    }


def _succeeded(output: dict) -> bool:
    response = output.get("response")
    return output.get("error") is None and response is not None and response["status_code"] == 200


def _counts(results: dict[int, dict], total: int) -> dict:
    ok = sum(_succeeded(o) for o in results.values())
    return {"total": total, "completed": ok, "failed": len(results) - ok}


def _completion_tokens(answer: dict) -> int:
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return 0
    tokens = usage.get("completion_tokens", usage.get("output_tokens", 0))
    return tokens if isinstance(tokens, int) else 0


def _json_line(obj: dict) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"
