"""A follower rank's loop: receive each call rank 0 broadcasts and run it on the local shard.

The results stay here (rank 0 samples); an error is raised identically on every rank (the
checks are deterministic), so a follower logs it and waits for the next call.
"""

from __future__ import annotations

import logging
from typing import Any

from llm_server.distributed.codec import Call, Op, decode
from llm_server.distributed.transport import Transport

log = logging.getLogger(__name__)


def apply(engine: Any, call: Call) -> None:
    """Run one decoded call on `engine`."""
    if call.op is Op.RUN:
        engine.run(call.plan)
    elif call.op is Op.PREFILL:
        engine.prefill(call.row, [int(t) for t in call.tokens])
    elif call.op is Op.DECODE:
        engine.decode(list(call.rows), [int(t) for t in call.tokens])
    elif call.op is Op.RELEASE:
        engine.release(call.row)
    elif call.op is Op.SCORE_BEGIN:
        engine.score_begin(call.value)
    elif call.op is Op.SCORE_CHUNK:
        engine.score_chunk(call.tokens, call.targets, call.value)
    elif call.op is Op.SCORE_END:
        engine.score_end()


def follow(engine: Any, transport: Transport) -> int:
    """Run rank 0's calls until it sends STOP; returns the number of calls run."""
    count = 0
    while True:
        call = decode(*transport.receive())
        if call.op is Op.STOP:
            return count
        try:
            apply(engine, call)
        except Exception as exc:  # noqa: BLE001 - rank 0 raised the same and reports it
            log.debug("call %s failed here as on rank 0: %s", call.op.name, exc)
        count += 1
