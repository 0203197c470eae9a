"""A batch on a many-model daemon (--models): each line runs on the model it names, loaded on
demand under the memory budget like any request; an unknown name fails its line alone."""

from __future__ import annotations

import openai

from llm_server.models.registry import ModelEntry
from llm_server.testing.managed import ManagedServer
from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint
from tests.batch.conftest import chat_line, jsonl, read_lines, submit, wait_for


def test_a_batch_loads_and_runs_on_the_models_it_names(tmp_path):
    paths = {
        name: build_tiny_checkpoint(tmp_path / name, TinySpec(arch="qwen3", seed=seed))
        for name, seed in (("alpha", 1), ("beta", 2))
    }
    entries = [ModelEntry(id=name, source=str(path)) for name, path in paths.items()]
    with ManagedServer(entries, data_dir=tmp_path / "data") as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        lines = [
            {
                **chat_line(f"{name}-{i}", "Hello"),
                "body": {**chat_line("", "Hello")["body"], "model": name},
            }
            for name in ("alpha", "beta", "nope")
            for i in range(2)
        ]
        done = wait_for(client, submit(client, jsonl(lines)).id, timeout=120)
        assert done.status == "completed"
        assert done.request_counts.completed == 4 and done.request_counts.failed == 2
        out = {
            o["custom_id"]: o["response"]["body"] for o in read_lines(client, done.output_file_id)
        }
        for name in ("alpha", "beta"):
            alone = client.chat.completions.create(
                model=name,
                messages=[{"role": "user", "content": "Hello"}],
                max_tokens=8,
                temperature=0,
            )
            for i in range(2):
                assert out[f"{name}-{i}"]["model"] == name
                assert (
                    out[f"{name}-{i}"]["choices"][0]["message"]["content"]
                    == alone.choices[0].message.content
                )
        errors = read_lines(client, done.error_file_id)
        assert {e["custom_id"] for e in errors} == {"nope-0", "nope-1"}
        assert all(e["response"]["status_code"] == 404 for e in errors)
