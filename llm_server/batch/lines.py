"""A batch input file read into its lines: each a request for the batch's endpoint, or the
error that line gets in the error file; a file that is not a batch file at all fails whole."""

from __future__ import annotations

import json
from dataclasses import dataclass

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
MAX_LINES = 50_000  # OpenAI's bound on the requests of one batch


@dataclass(frozen=True)
class LineError:
    """Why one input line is not run: `code` is stable, `message` says what to fix."""

    code: str
    message: str


@dataclass(frozen=True)
class BatchLine:
    """Input line `index` (0-based): its request body, or the error it fails with."""

    index: int
    custom_id: str | None
    body: dict | None  # None when `error` is set
    error: LineError | None = None


class InputFileError(ValueError):
    """The file as a whole is not a batch input (the batch fails validation)."""

    def __init__(self, code: str, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.line = line  # 1-based, as OpenAI reports it; None: the whole file

    def as_error(self) -> dict:
        return {"code": self.code, "message": str(self), "param": None, "line": self.line}


def parse_input(content: bytes, endpoint: str) -> list[BatchLine]:
    """The lines of a batch input file for `endpoint` (blank lines skipped).

    Raises InputFileError when the file is not UTF-8, holds no line, more than MAX_LINES, or
    no line that parses as JSON (a file of another format, not one bad line)."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputFileError("invalid_file", f"the file is not UTF-8 (byte {exc.start})") from None
    raw_lines = [(n, s) for n, s in enumerate(text.splitlines(), 1) if s.strip()]
    if not raw_lines:
        raise InputFileError("empty_file", "the input file has no request lines")
    if len(raw_lines) > MAX_LINES:
        raise InputFileError(
            "too_many_requests", f"the file has {len(raw_lines)} lines; a batch takes {MAX_LINES}"
        )
    seen: set[str] = set()
    lines = [_line(i, s, endpoint, seen) for i, (_, s) in enumerate(raw_lines)]
    if all(line.error is not None and line.error.code == "invalid_json_line" for line in lines):
        raise InputFileError(
            "invalid_json_line",
            "no line of the file is a JSON object; a batch file has one request per line "
            '({"custom_id": ..., "method": "POST", "url": ..., "body": {...}})',
            line=raw_lines[0][0],
        )
    return lines


def _line(index: int, text: str, endpoint: str, seen: set[str]) -> BatchLine:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        data = None
    if not isinstance(data, dict):
        return _failed(index, None, "invalid_json_line", "the line is not a JSON object")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _failed(index, None, "missing_custom_id", "'custom_id' must be a non-empty string")
    if custom_id in seen:
        return _failed(
            index, custom_id, "duplicate_custom_id", f"custom_id {custom_id!r} is used twice"
        )
    seen.add(custom_id)
    if data.get("method", "POST") != "POST":
        return _failed(index, custom_id, "invalid_method", "'method' must be 'POST'")
    if data.get("url") != endpoint:
        return _failed(
            index,
            custom_id,
            "mismatched_endpoint",
            f"the line's url {data.get('url')!r} is not the batch's endpoint {endpoint!r}",
        )
    body = data.get("body")
    if not isinstance(body, dict):
        return _failed(index, custom_id, "invalid_body", "'body' must be a JSON object")
    if body.get("stream"):
        return _failed(index, custom_id, "invalid_body", "'stream' is not supported in a batch")
    return BatchLine(index, custom_id, body)


def _failed(index: int, custom_id: str | None, code: str, message: str) -> BatchLine:
    return BatchLine(index, custom_id, None, LineError(code, message))
