"""The vision workload's inputs and report (the servers themselves run in tests/vision)."""

from __future__ import annotations

import base64
import io
import json

import pytest
from PIL import Image

from llm_server.benchmark import servers, vision
from llm_server.benchmark.cli import build_parser, main, settings_from


def _decoded(prompt) -> Image.Image:
    url = prompt.messages[0]["content"][0]["image_url"]["url"]
    assert url.startswith("data:image/png;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


def test_the_images_are_fixed_distinct_pngs_with_a_question_after_each():
    prompts = vision.vision_prompts()
    again = vision.vision_prompts()
    assert [p.messages for p in prompts] == [p.messages for p in again]  # same bytes every run
    pixels = {_decoded(p).tobytes() for p in prompts}
    assert len(pixels) == vision.IMAGES  # every image differs
    first = _decoded(prompts[0])
    assert first.size == (vision.SIDE, vision.SIDE) and first.format == "PNG"
    content = prompts[1].messages[0]["content"]
    assert [part["type"] for part in content] == ["image_url", "text"]
    assert content[1]["text"] == vision.QUESTIONS[1]


def test_mlx_vlm_server_is_started_on_the_same_checkpoint_and_a_free_port(tmp_path):
    spec = servers.ServerSpec("mlx_vlm", tmp_path, 4, max_queued=8)
    argv = servers.command_for(spec, 8123)
    assert argv[1:] == [
        "-m", "mlx_vlm.server", "--model", str(tmp_path), "--host", "127.0.0.1", "--port", "8123",
    ]  # fmt: skip


def test_tower_time_is_read_from_the_metrics_text(monkeypatch):
    text = (
        "# TYPE llm_server_vision_encode_seconds counter\n"
        "llm_server_vision_encode_seconds_total 0.75\n"
        "llm_server_vision_encode_seconds_created 1.7e9\n"
        "llm_server_vision_images_total 3.0\n"
    )

    class Response:
        pass

    response = Response()
    response.text = text
    monkeypatch.setattr(vision.httpx, "get", lambda *a, **k: response)
    assert vision.tower_seconds("http://x") == (0.75, 3.0)
    response.text = "llm_requests_total 1\n"
    assert vision.tower_seconds("http://x") is None


def test_the_table_gives_the_ratio_and_marks_what_did_not_run(tmp_path):
    settings = settings_from(
        build_parser().parse_args(
            ["--concurrency", "1,4", "--requests", "8", "--out", str(tmp_path)]
        )
    )
    runs = {
        "ours": {1: {"tokens_per_s": 30.0, "ttft_p50_s": 0.5, "failed": 0,
                     "tower_s_per_image": 0.125},
                 4: {"tokens_per_s": 90.0, "ttft_p50_s": 0.9, "failed": 0}},
        "mlx_vlm": {1: {"tokens_per_s": 20.0, "ttft_p50_s": 0.7, "failed": 0},
                    4: {"error": "mlx_vlm.server exited with code 1"}},
    }  # fmt: skip
    rows = vision.table(runs, settings).splitlines()
    assert "| 1 | 30.0 | 20.0 | 1.50x | 0.50 | 0.70 | 0.125 | 0 / 0 |" in rows
    assert "| 4 | 90.0 | - | - | 0.90 | - | - | 0 / mlx_vlm.server exited with code 1 |" in rows


def test_a_text_checkpoint_is_refused_with_what_the_workload_needs(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(SystemExit) as exc:
        main(["--workload", "vision", "--model", str(tmp_path), "--out", str(tmp_path / "o")])
    assert "needs a vision-language checkpoint" in str(exc.value)
    assert "has no vision_config" in str(exc.value)
