"""A follower rank's loop: receive each call rank 0 broadcasts and run it on the local shard.

The results stay here (rank 0 samples); an error is raised identically on every rank (the
checks are deterministic), so a follower logs it and waits for the next call. Each receive
reports the calls completed so far back to rank 0 (its /health), and stamps `heard` for the
follower's watchdog (launch.py), which ends a follower whose rank 0 has vanished.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from llm_server.distributed.codec import Call, Op, decode
from llm_server.distributed.transport import Transport

log = logging.getLogger(__name__)


class Heard:
    """When this follower last heard from rank 0 (monotonic seconds), and whether it ever did
    (before the first call rank 0 may still be loading its shard)."""

    def __init__(self) -> None:
        self.at = time.monotonic()
        self.ever = False

    def now(self) -> None:
        self.at = time.monotonic()
        self.ever = True

    def silent_for(self) -> float:
        return time.monotonic() - self.at


def apply(engine: Any, call: Call) -> None:
    """Run one decoded call on `engine`."""
    if call.op is Op.RUN:
        engine.run(call.plan)
    elif call.op is Op.PREFILL:
        engine.prefill(call.row, call.tokens.tolist())
    elif call.op is Op.DECODE:
        engine.decode(list(call.rows), call.tokens.tolist())
    elif call.op is Op.RELEASE:
        engine.release(call.row)
    elif call.op is Op.SCORE_BEGIN:
        engine.score_begin(call.value)
    elif call.op is Op.SCORE_CHUNK:
        engine.score_chunk(call.tokens, call.targets, call.value)
    elif call.op is Op.SCORE_END:
        engine.score_end()


def follow(engine: Any, transport: Transport, heard: Heard | None = None) -> int:
    """Run rank 0's calls until it sends STOP; returns the number of calls run (heartbeats
    are not calls)."""
    count = 0
    while True:
        call = decode(*transport.receive(count))
        if heard is not None:
            heard.now()
        if call.op is Op.STOP:
            return count
        if call.op is Op.HEARTBEAT:
            continue
        try:
            apply(engine, call)
        except Exception as exc:  # noqa: BLE001 - rank 0 raised the same and reports it
            log.debug("call %s failed here as on rank 0: %s", call.op.name, exc)
        count += 1
