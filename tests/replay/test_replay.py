"""Replaying the recorded traffic: in-process serial and concurrent, over HTTP, corrupt lines."""

from __future__ import annotations

import asyncio
import json

from llm_server.api.app import AppState, create_app
from replay import cli
from replay.log import read_log
from replay.report import Report
from replay.runner import replay_app, replay_url

NON_DETERMINISTIC_LINE = 20  # the temperature 0.9 chat


def _assert_reproduced(report: Report, random_line: int = NON_DETERMINISTIC_LINE) -> None:
    assert report.totals.requests == 20
    assert all(r.status == 200 for r in report.results), report.summary()
    det = [r for r in report.results if r.deterministic]
    assert [r.line for r in report.results if not r.deterministic] == [random_line]
    assert all(r.identical for r in det), report.summary()
    assert report.totals.deterministic_different == 0
    assert not report.failed_check
    assert report.totals.completion_tokens > 0
    assert report.totals.latency_p50 <= report.totals.latency_p99


def test_in_process_serial_then_concurrent(recording, tiny_model_path, make_service) -> None:
    svc = make_service(tiny_model_path, concurrent=4, max_queued=20)
    app = create_app(AppState(svc, svc.config.model_id))
    log = read_log(recording.path)
    busy = lambda: svc.scheduler.stats().max_rows_busy  # noqa: E731

    serial = asyncio.run(replay_app(app, log, concurrent=False, max_rows_busy=busy))
    _assert_reproduced(serial)
    # one request at a time; the two-prompt completion is the only one that takes two rows
    assert serial.totals.max_rows_busy == 2

    concurrent = asyncio.run(replay_app(app, log, concurrent=True, max_rows_busy=busy))
    _assert_reproduced(concurrent)
    assert concurrent.totals.max_rows_busy == 4  # the scheduler really batched requests
    assert concurrent.concurrent and "max rows busy" in concurrent.summary()
    # batched (rows=4) and serial servers report different fingerprints (S9)
    assert {r.fingerprint for r in concurrent.results} == {svc.fingerprint}
    assert svc.fingerprint != recording.fingerprint


def test_live_replay_over_http(recording, tiny_model_path, live_server, tmp_path) -> None:
    srv = live_server(tiny_model_path, concurrent=4, max_queued=20)
    report = asyncio.run(replay_url(srv.url, read_log(recording.path), concurrent=True))
    _assert_reproduced(report)
    assert srv.service.scheduler.stats().max_rows_busy > 1
    assert report.totals.max_rows_busy is not None  # sampled from /health

    out = tmp_path / "report.json"
    code = cli.main([str(recording.path), "--url", srv.url, "--check", "--report", str(out)])
    assert code == 0
    saved = json.loads(out.read_text())
    assert saved["totals"]["requests"] == 20
    assert saved["totals"]["deterministic_different"] == 0
    assert [r["line"] for r in saved["results"]] == list(range(1, 21))


def test_corrupt_lines_are_reported_and_skipped(
    recording, tiny_model_path, make_service, tmp_path
) -> None:
    lines = recording.path.read_text().splitlines()
    lines.insert(3, '{"v": 1, "endpoint": "/v1/chat/comp')  # cut off: line 4
    lines.insert(9, "not json at all")  # line 10
    lines.insert(15, json.dumps({"v": 1, "endpoint": "/v1/completions"}))  # line 16
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text("\n".join(lines) + "\n")

    log = read_log(damaged)
    assert [(c.line, c.error.split(":")[0]) for c in log.corrupt] == [
        (4, "not JSON"),
        (10, "not JSON"),
        (16, "missing field(s) request, response, status"),
    ]
    svc = make_service(tiny_model_path)
    report = asyncio.run(replay_app(create_app(AppState(svc, svc.config.model_id)), log))
    _assert_reproduced(report, random_line=NON_DETERMINISTIC_LINE + 3)
    assert report.totals.corrupt_lines == 3
    assert "corrupt line 10 skipped: not JSON" in report.summary()
    assert 4 not in [r.line for r in report.results]


def test_an_altered_output_is_found_at_its_position(
    recording, tiny_model_path, make_service, tmp_path
) -> None:
    lines = recording.path.read_text().splitlines()
    entry = json.loads(lines[0])
    content = entry["response"]["choices"][0]["message"]["content"]
    entry["response"]["choices"][0]["message"]["content"] = content[:3] + "#" + content[4:]
    lines[0] = json.dumps(entry)
    altered = tmp_path / "altered.jsonl"
    altered.write_text("\n".join(lines) + "\n")

    svc = make_service(tiny_model_path)
    report = asyncio.run(
        replay_app(create_app(AppState(svc, svc.config.model_id)), read_log(altered))
    )
    assert report.failed_check and report.totals.deterministic_different == 1
    first = report.results[0]
    assert not first.identical
    assert (first.difference.field, first.difference.unit, first.difference.position) == (
        "choices[0].message.content",
        "char",
        3,
    )
    assert "DIFFERS: choices[0].message.content at char 3" in report.summary()
