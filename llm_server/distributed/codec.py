"""The engine calls rank 0 broadcasts, as int32 arrays: a fixed header and a payload.

Header: [MAGIC, op, payload_len, a, b, c, 0, 0] (`HEADER` ints). The payload holds the call's
token ids and rows; its length is in the header so a follower knows what to receive next.
Pure numpy: the codec is tested without a group.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from llm_server.engines.plan import DecodeRow, PrefillChunk, StepPlan

HEADER = 8
MAGIC = 0x4C4C4D53  # "LLMS": a header that is not one of ours means the ranks are out of step


class Op(enum.IntEnum):
    STOP = 1  # rank 0 is shutting down: followers leave their loop
    RUN = 2  # engine.run(plan): decode rows and prompt chunks
    PREFILL = 3  # engine.prefill(row, tokens)
    DECODE = 4  # engine.decode(rows, tokens)
    RELEASE = 5  # engine.release(row)
    SCORE_BEGIN = 6  # engine.score_begin(batch)
    SCORE_CHUNK = 7  # engine.score_chunk(tokens, targets, top_k)
    SCORE_END = 8  # engine.score_end()
    HEARTBEAT = 9  # nothing to run: rank 0 is alive and idle (the followers' watchdog)


@dataclass(frozen=True)
class Call:
    """One decoded engine call."""

    op: Op
    plan: StepPlan | None = None
    row: int = 0
    rows: tuple[int, ...] = ()
    tokens: np.ndarray | None = None  # 1-D (prefill, decode) or [N, q] (scoring)
    targets: np.ndarray | None = None  # [N, q] (scoring)
    value: int = 0  # batch (score_begin) or top_k (score_chunk)


def _header(op: Op, payload: np.ndarray, a: int = 0, b: int = 0, c: int = 0) -> np.ndarray:
    return np.array([MAGIC, int(op), payload.size, a, b, c, 0, 0], dtype=np.int32)


def _ints(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int32).reshape(-1)


def encode_plan(plan: StepPlan) -> tuple[np.ndarray, np.ndarray]:
    """The forward part of a plan: decode (row, token) pairs, then each chunk's fields and
    whole prompt (a fresh chunk opens its row from the prompt's start)."""
    ints = [len(plan.decode)]
    for d in plan.decode:
        ints += (d.row, d.token)
    ints.append(len(plan.prefill))
    for c in plan.prefill:
        ints += (c.seq, c.row, c.start, c.end, len(c.prompt), *c.prompt)
    payload = _ints(ints)
    return _header(Op.RUN, payload), payload


def encode(call: Call) -> tuple[np.ndarray, np.ndarray]:
    """(header, payload) of `call`."""
    if call.op is Op.RUN:
        assert call.plan is not None
        return encode_plan(call.plan)
    if call.op is Op.PREFILL:
        payload = _ints(call.tokens)
        return _header(call.op, payload, call.row), payload
    if call.op is Op.DECODE:
        payload = np.concatenate([_ints(call.rows), _ints(call.tokens)])
        return _header(call.op, payload, len(call.rows)), payload
    if call.op is Op.SCORE_CHUNK:
        tokens = np.asarray(call.tokens)
        n, q = tokens.shape
        payload = np.concatenate([_ints(tokens), _ints(call.targets)])
        return _header(call.op, payload, n, q, call.value), payload
    payload = np.zeros(0, np.int32)
    return _header(call.op, payload, call.row if call.op is Op.RELEASE else call.value), payload


def payload_size(header: np.ndarray) -> int:
    """The payload length a header announces (checks the header is one of ours)."""
    if header.shape != (HEADER,) or int(header[0]) != MAGIC:
        raise ValueError(f"not a plan header: {header.tolist()} (ranks out of step)")
    return int(header[2])


def decode(header: np.ndarray, payload: np.ndarray) -> Call:
    """The call `encode` gave (header, payload) for."""
    if payload.size != payload_size(header):
        raise ValueError(f"payload of {payload.size} ints, header says {int(header[2])}")
    op, a, b, c = Op(int(header[1])), int(header[3]), int(header[4]), int(header[5])
    p = payload.tolist() if op in (Op.RUN, Op.DECODE) else None
    if op is Op.RUN:
        assert p is not None
        i, decode_rows = 1, []
        for _ in range(p[0]):
            decode_rows.append(DecodeRow(row=p[i], token=p[i + 1]))
            i += 2
        chunks, count = [], p[i]
        i += 1
        for _ in range(count):
            seq, row, start, end, n = p[i : i + 5]
            chunks.append(PrefillChunk(seq, row, tuple(p[i + 5 : i + 5 + n]), start, end))
            i += 5 + n
        return Call(op, plan=StepPlan(decode=tuple(decode_rows), prefill=tuple(chunks)))
    if op is Op.PREFILL:
        return Call(op, row=a, tokens=payload.copy())
    if op is Op.DECODE:
        assert p is not None
        return Call(op, rows=tuple(p[:a]), tokens=np.asarray(p[a:], np.int32))
    if op is Op.SCORE_CHUNK:
        tokens = payload[: a * b].reshape(a, b).copy()
        targets = payload[a * b :].reshape(a, b).copy()
        return Call(op, tokens=tokens, targets=targets, value=c)
    if op is Op.RELEASE:
        return Call(op, row=a)
    return Call(op, value=a)
