"""`llm-replay FILE --url URL`: send a request log to a live server and report how it answered."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from replay.log import RequestLog, read_log
from replay.report import Report

API_KEY_ENV = "LLM_SERVER_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llm-replay", description=__doc__)
    p.add_argument("file", help="request log written by llm-server --log-requests")
    p.add_argument(
        "--url", required=True, help="base URL of the server, e.g. http://127.0.0.1:8080"
    )
    p.add_argument(
        "--concurrent",
        action="store_true",
        help="send every request at once (default: one after another)",
    )
    p.add_argument("--api-key", help=f"Bearer token to send (default: env {API_KEY_ENV})")
    p.add_argument("--report", metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a deterministic (temperature 0) request differs from the log",
    )
    return p


def load(path: str | Path, prog: str) -> RequestLog:
    """Read the log or exit with a message a user can act on."""
    try:
        return read_log(path)
    except OSError as exc:
        raise SystemExit(f"{prog}: cannot read the log {path}: {exc.strerror or exc}") from None


def finish(report: Report, report_path: str | None, check: bool) -> int:
    """Print the summary, write the JSON report, return the exit code."""
    print(report.summary(), flush=True)
    if report_path:
        report.write_json(report_path)
    return 1 if check and report.failed_check else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from replay.runner import replay_url

    log = load(args.file, "llm-replay")
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    report = asyncio.run(replay_url(args.url.rstrip("/"), log, args.concurrent, key))
    code = finish(report, args.report, args.check)
    if argv is None:
        sys.exit(code)
    return code
