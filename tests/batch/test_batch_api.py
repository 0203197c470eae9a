"""The OpenAI Batch API end to end with the openai SDK against a live server on the tiny model:
upload, create, poll, download; answers equal to the same requests sent interactively."""

from __future__ import annotations

import io

import httpx
import openai
import pytest

from tests.batch.conftest import (
    MAX_FILE_BYTES,
    chat_line,
    jsonl,
    read_lines,
    submit,
    wait_for,
)

PROMPTS = ["Hello", "The capital of France is", "Count: one two", "def main():", "Why?", "Hi"]


def test_chat_batch_end_to_end_answers_as_interactive(client):
    lines = [chat_line(f"req-{i}", p) for i, p in enumerate(PROMPTS)]
    batch = submit(client, jsonl(lines))
    assert batch.status == "validating"
    assert batch.endpoint == "/v1/chat/completions"
    done = wait_for(client, batch.id)
    assert done.status == "completed"
    assert done.request_counts.total == len(PROMPTS)
    assert done.request_counts.completed == len(PROMPTS)
    assert done.request_counts.failed == 0
    assert done.error_file_id is None
    assert done.completed_at and done.in_progress_at and done.finalizing_at
    out = read_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == sorted(f"req-{i}" for i in range(len(PROMPTS)))
    for o in out:
        assert o["response"]["status_code"] == 200
        assert o["error"] is None
        body = o["response"]["body"]
        i = int(o["custom_id"].removeprefix("req-"))
        alone = client.chat.completions.create(
            model="tiny-qwen3",
            messages=[{"role": "user", "content": PROMPTS[i]}],
            max_tokens=8,
            temperature=0,
        )
        assert body["choices"][0]["message"]["content"] == alone.choices[0].message.content
        assert body["usage"]["completion_tokens"] == alone.usage.completion_tokens


def test_completions_batch(client):
    lines = [
        {
            "custom_id": f"c{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny-qwen3", "prompt": p, "max_tokens": 6, "temperature": 0},
        }
        for i, p in enumerate(PROMPTS[:3])
    ]
    done = wait_for(client, submit(client, jsonl(lines), "/v1/completions").id)
    assert done.status == "completed" and done.request_counts.completed == 3
    by_id = {o["custom_id"]: o for o in read_lines(client, done.output_file_id)}
    for i, p in enumerate(PROMPTS[:3]):
        alone = client.completions.create(model="tiny-qwen3", prompt=p, max_tokens=6, temperature=0)
        assert by_id[f"c{i}"]["response"]["body"]["choices"][0]["text"] == alone.choices[0].text


def test_bad_input_catalogue_fails_only_its_lines(client, batch_server):
    long_prompt = "hello " * 1500  # past the tiny model's 1024-position context
    lines = [
        chat_line("good-1", "Hello"),
        '{"custom_id": "broken", "method": "POST", "url": ',  # malformed JSON
        {**chat_line("other-endpoint", "Hi"), "url": "/v1/embeddings"},
        chat_line("too-long", long_prompt),
        {
            **chat_line("unknown-model", "Hi"),
            "body": {**chat_line("x", "Hi")["body"], "model": "nope"},
        },
        chat_line("good-2", "The capital of France is"),
        {"method": "POST", "url": "/v1/chat/completions", "body": {}},  # no custom_id
        chat_line("good-1", "duplicate id"),
    ]
    done = wait_for(client, submit(client, jsonl(lines)).id)
    assert done.status == "completed"
    assert done.request_counts.total == 8
    assert done.request_counts.completed == 2
    assert done.request_counts.failed == 6
    ok = read_lines(client, done.output_file_id)
    assert sorted(o["custom_id"] for o in ok) == ["good-1", "good-2"]
    errors = read_lines(client, done.error_file_id)
    assert len(errors) == 6
    by_id = {e["custom_id"]: e for e in errors if e["custom_id"] not in (None, "good-1")}
    assert by_id["other-endpoint"]["error"]["code"] == "mismatched_endpoint"
    assert by_id["too-long"]["response"]["status_code"] == 400
    assert "context" in by_id["too-long"]["response"]["body"]["error"]["message"]
    assert by_id["unknown-model"]["response"]["status_code"] == 404
    assert by_id["unknown-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    codes = sorted(e["error"]["code"] for e in errors if e["error"] is not None)
    assert codes == [
        "duplicate_custom_id",
        "invalid_json_line",
        "mismatched_endpoint",
        "missing_custom_id",
    ]
    # the daemon is up and answers
    assert httpx.get(batch_server.url + "/health", timeout=10).status_code == 200


def test_a_file_that_is_not_jsonl_fails_the_batch_at_validation(client):
    done = wait_for(client, submit(client, b"this is not\na batch file\n").id)
    assert done.status == "failed"
    assert done.failed_at is not None
    assert done.errors.data[0].code == "invalid_json_line"
    assert done.output_file_id is None and done.error_file_id is None


def test_a_file_over_max_file_size_is_refused(client):
    big = jsonl([chat_line(f"r{i}", "x" * 500) for i in range(MAX_FILE_BYTES // 500 + 10)])
    assert len(big) > MAX_FILE_BYTES
    with pytest.raises(openai.APIStatusError) as err:
        client.files.create(file=("big.jsonl", io.BytesIO(big)), purpose="batch")
    assert err.value.status_code == 413
    assert "--max-file-size" in err.value.message


def test_create_refuses_unknown_file_and_endpoint(client):
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    file = client.files.create(
        file=("in.jsonl", io.BytesIO(jsonl([chat_line("a", "Hi")]))), purpose="batch"
    )
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=file.id, endpoint="/v1/moderations", completion_window="24h"
        )


def test_files_list_get_content_delete(client):
    content = jsonl([chat_line("a", "Hi")])
    file = client.files.create(file=("mine.jsonl", io.BytesIO(content)), purpose="batch")
    assert file.bytes == len(content) and file.filename == "mine.jsonl"
    assert client.files.retrieve(file.id).id == file.id
    assert client.files.content(file.id).content == content
    assert file.id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(file.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file.id)


def test_batches_list_pages_newest_first(client):
    ids = [submit(client, jsonl([chat_line("a", "Hi", max_tokens=1)])).id for _ in range(3)]
    for batch_id in ids:
        wait_for(client, batch_id)
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2]
    assert first.has_more is True
    rest = client.batches.list(limit=2, after=first.data[-1].id)
    assert rest.data[0].id == ids[0]
    every = [b.id for b in client.batches.list(limit=1)]  # the SDK follows has_more
    assert every.index(ids[2]) < every.index(ids[1]) < every.index(ids[0])


def test_cancel_keeps_what_finished(client):
    lines = [chat_line(f"r{i}", "Hello", max_tokens=200) for i in range(40)]
    batch = submit(client, jsonl(lines))
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_for(client, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    finished = read_lines(client, done.output_file_id) + read_lines(client, done.error_file_id)
    assert len(finished) == done.request_counts.completed + done.request_counts.failed < 40


def test_progress_in_metrics(client, batch_server):
    done = wait_for(client, submit(client, jsonl([chat_line("m", "Hi", max_tokens=2)])).id)
    assert done.status == "completed"
    text = httpx.get(batch_server.url + "/metrics", timeout=10).text
    values = {
        line.split()[0]: float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("llm_server_batch_")
    }
    assert values["llm_server_batch_lines_answered_total"] >= 1
    for name in ("running_lines", "running_lines_done", "tokens_per_second", "eta_seconds"):
        assert f"llm_server_batch_{name}" in values


def test_embeddings_and_responses_batches_answer_as_interactive(client):
    texts = ["The capital of France is Paris.", "Berlin"]
    lines = [
        {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": {"input": t}}
        for i, t in enumerate(texts)
    ]
    done = wait_for(client, submit(client, jsonl(lines), "/v1/embeddings").id)
    assert done.status == "completed" and done.request_counts.completed == 2
    by_id = {o["custom_id"]: o for o in read_lines(client, done.output_file_id)}
    for i, t in enumerate(texts):
        alone = client.embeddings.create(model="tiny-qwen3", input=t, encoding_format="float")
        got = by_id[f"e{i}"]["response"]["body"]["data"][0]["embedding"]
        assert got == alone.data[0].embedding

    body = {"model": "tiny-qwen3", "input": "Hello", "max_output_tokens": 8, "temperature": 0}
    line = {"custom_id": "r", "method": "POST", "url": "/v1/responses", "body": body}
    done = wait_for(client, submit(client, jsonl([line]), "/v1/responses").id)
    assert done.status == "completed", done
    answer = read_lines(client, done.output_file_id)[0]["response"]["body"]
    alone = client.responses.create(**body)
    texts_out = [
        c["text"] for item in answer["output"] if item["type"] == "message" for c in item["content"]
    ]
    assert "".join(texts_out) == alone.output_text
