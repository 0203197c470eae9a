"""The real agents send an image to a vision-language model (issue 49): Claude Code reads a PNG
in its working folder with its own Read tool, `codex exec -i shot.png` attaches one, and Codex's
own view_image tool returns one inside a `function_call_output`.

The checkpoint is `agents_vision.py`'s tiny Gemma 3 VLM (65,536 positions, the agents' corpus
tokenizer, an early EOS in the weights, so answers end after a few tokens: nothing caps
`max_tokens`). Every model request must be answered 200, and the image must reach the prompt:
the request that carries it reports more prompt tokens than the same request sent again with
the image left out, by at least the image's placeholder positions (`TOKENS_PER_IMAGE`, plus
the begin/end-of-image markers around them).
"""

from __future__ import annotations

import base64
import copy
from pathlib import Path

import httpx
import pytest

from llm_server.benchmark.vision import image_png
from llm_server.testing.agents_proxy import (
    Exchange,
    RecordingProxy,
    prompt_usage,
    tool_results,
)
from llm_server.testing.agents_run import run_agent
from llm_server.testing.agents_vision import TOKENS_PER_IMAGE, build_agent_vlm_checkpoint
from llm_server.testing.live import serving
from tests.agents.conftest import STEP_TOKENS

MODEL = "agent-vlm"
CANNED_ID = "toolu_canned_1"  # agents_proxy.canned_tool_use's id
IMAGE_TYPES = ("image", "input_image")
# the image run is `\n\n<start_of_image>`, the placeholders, `<end_of_image>\n\n`
MARKER_SLACK = 8


@pytest.fixture(scope="session")
def vlm_server(tmp_path_factory: pytest.TempPathFactory):
    """A live server on the agents' VLM checkpoint, the hub offline (the processor's files are
    all in the folder)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        path = build_agent_vlm_checkpoint(tmp_path_factory.mktemp("agents-vision") / MODEL)
        with serving(path, concurrent=2, step_tokens=STEP_TOKENS) as srv:
            yield srv


def _check_calls(proxy: RecordingProxy, run) -> list[Exchange]:
    calls = proxy.model_calls()
    assert calls, f"the agent sent no model request\n{run.describe()}"
    for ex in calls:
        assert ex.status == 200, (
            f"{ex.path} -> {ex.status}: {ex.response[:800]!r}\n{run.describe()}"
        )
    return calls


def _images(node) -> list[dict]:
    """Every image part (Messages `image`, Responses `input_image`) anywhere in `node`."""
    if isinstance(node, dict):
        found = [node] if node.get("type") in IMAGE_TYPES else []
        return found + [i for v in node.values() for i in _images(v)]
    if isinstance(node, list):
        return [i for v in node for i in _images(v)]
    return []


def _without_images(node):
    """`node` with every image part left out (a content or output list left empty becomes
    "")."""
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            kept = _without_images(value)
            if key in ("content", "output") and isinstance(value, list) and not kept:
                kept = ""
            out[key] = kept
        return out
    if isinstance(node, list):
        return [
            _without_images(v)
            for v in node
            if not (isinstance(v, dict) and v.get("type") in IMAGE_TYPES)
        ]
    return node


def _prompt_tokens_without_images(url: str, ex: Exchange) -> int:
    """The prompt tokens of `ex`'s request sent again, unstreamed, without its images."""
    body = _without_images(copy.deepcopy(ex.body))
    body["stream"] = False
    if ex.path.endswith("/messages"):
        body["max_tokens"] = 1
    else:
        body["max_output_tokens"] = 16
    resp = httpx.post(url + ex.path, json=body, timeout=600)
    assert resp.status_code == 200, resp.text[:800]
    usage = resp.json()["usage"]
    if ex.path.endswith("/messages"):
        return (
            usage["input_tokens"]
            + (usage.get("cache_read_input_tokens") or 0)
            + (usage.get("cache_creation_input_tokens") or 0)
        )
    return usage["input_tokens"]


def _assert_image_counted(url: str, ex: Exchange) -> tuple[int, int]:
    with_image, _ = prompt_usage(ex)
    without = _prompt_tokens_without_images(url, ex)
    extra = with_image - without
    assert TOKENS_PER_IMAGE <= extra <= TOKENS_PER_IMAGE + MARKER_SLACK, (with_image, without)
    print(f"{ex.path}: {with_image} prompt tokens, {without} without the image")
    return with_image, without


def test_sampled_answers_end_early(vlm_server) -> None:
    """The checkpoint's early EOS, as the agents meet it (they send no temperature): every
    sampled answer is non-empty and ends with the EOS within a few dozen tokens."""
    prompts = ["Say hello.", "Describe the attached image.", "What does this do? " * 30]
    for i in range(12):
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
            "max_tokens": 256,
            "seed": i,  # sampled as the agents sample, but the same draws every run
        }
        resp = httpx.post(vlm_server.url + "/v1/chat/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text[:800]
        answer = resp.json()
        assert answer["choices"][0]["finish_reason"] == "stop", answer
        assert answer["choices"][0]["message"]["content"].strip(), answer
        assert answer["usage"]["completion_tokens"] <= 64, answer


def test_claude_code_reads_a_png_with_its_read_tool(vlm_server, tmp_path: Path) -> None:
    """The first request offering Read is answered (by the proxy) with Read on shot.png;
    Claude Code runs its own Read tool, which returns the PNG as an image block inside the
    `tool_result` of its next request; the server answers it with the image in the prompt."""
    work = tmp_path / "work"  # agents_run's working folder for the agent
    work.mkdir(parents=True)
    png = work / "shot.png"
    png.write_bytes(image_png(0))
    with RecordingProxy(vlm_server.url, canned_call=("Read", {"file_path": str(png)})) as proxy:
        run = run_agent("claude-code", proxy.url, MODEL, "Describe shot.png", tmp_path, timeout=900)
    calls = _check_calls(proxy, run)
    canned = [i for i, ex in enumerate(calls) if ex.forced]
    assert canned, f"no request offered Read\n{run.describe()}"
    answered = [ex for ex in calls[canned[0] + 1 :] if CANNED_ID in tool_results(ex)]
    assert answered, f"no later request carried Read's result\n{run.describe()}"
    after = answered[0]
    results = [
        block
        for msg in after.body["messages"]
        if isinstance(msg.get("content"), list)
        for block in msg["content"]
        if block.get("type") == "tool_result" and block.get("tool_use_id") == CANNED_ID
    ]
    assert len(results) == 1, results
    # what Claude Code sends: the tool_result's content is the one image block, base64 PNG,
    # the file's own bytes
    content = results[0]["content"]
    assert isinstance(content, list) and [b["type"] for b in content] == ["image"], content
    source = content[0]["source"]
    assert (source["type"], source["media_type"]) == ("base64", "image/png"), source["type"]
    assert base64.b64decode(source["data"]) == png.read_bytes()
    _assert_image_counted(vlm_server.url, after)
    assert run.returncode == 0, run.describe()


def test_codex_exec_attaches_an_image(vlm_server, tmp_path: Path) -> None:
    """`codex exec PROMPT -i shot.png`: the first request's input carries the file as an
    `input_image` (a data URL), and the server answers it with the image in the prompt."""
    png = tmp_path / "shot.png"
    png.write_bytes(image_png(0))
    with RecordingProxy(vlm_server.url) as proxy:
        run = run_agent(
            "codex",
            proxy.url,
            MODEL,
            "Describe the attached image.",
            tmp_path,
            timeout=900,
            images=(str(png),),
        )
    calls = _check_calls(proxy, run)
    first = calls[0]
    assert first.path.endswith("/responses"), first.path
    images = _images(first.body["input"])
    assert len(images) == 1, f"the first request's images: {str(first.body['input'])[-1500:]}"
    # what Codex sends: a user message of input_text `<image name=[Image #1] path="...">`,
    # the input_image (a data URL, detail "high"), input_text `</image>`, then the prompt
    turn = next(item for item in first.body["input"] if images[0] in item.get("content", []))
    assert turn["role"] == "user"
    kinds = [part["type"] for part in turn["content"]]
    assert kinds == ["input_text", "input_image", "input_text", "input_text"], kinds
    assert turn["content"][0]["text"].startswith("<image name=")
    assert turn["content"][-1]["text"] == "Describe the attached image."
    head, data = images[0]["image_url"].split(",", 1)
    assert head == "data:image/png;base64"
    assert base64.b64decode(data) == png.read_bytes()
    _assert_image_counted(vlm_server.url, first)
    assert run.returncode == 0, run.describe()


def test_codex_view_image_returns_the_png_in_its_function_call_output(
    vlm_server, tmp_path: Path
) -> None:
    """The first request offering view_image is answered (by the proxy) with view_image on
    shot.png; Codex runs its own tool and sends the PNG back in its next request; the server
    answers it with the image in the prompt."""
    work = tmp_path / "work"  # agents_run's working folder for the agent
    work.mkdir(parents=True)
    png = work / "shot.png"
    png.write_bytes(image_png(0))
    canned = ("view_image", {"path": str(png)})
    with RecordingProxy(vlm_server.url, canned_call=canned) as proxy:
        run = run_agent("codex", proxy.url, MODEL, "Look at shot.png.", tmp_path, timeout=900)
    calls = _check_calls(proxy, run)
    forced = [i for i, ex in enumerate(calls) if ex.forced]
    assert forced, f"no request offered view_image\n{run.describe()}"
    answered = [ex for ex in calls[forced[0] + 1 :] if "call_canned_1" in tool_results(ex)]
    assert answered, f"no later request carried view_image's result\n{run.describe()}"
    after = answered[0]
    # what Codex sends: a function_call_output whose output is the one input_image (a data
    # URL of the file's bytes, detail "high")
    outputs = [
        item
        for item in after.body["input"]
        if item.get("type") == "function_call_output" and item["call_id"] == "call_canned_1"
    ]
    assert len(outputs) == 1, str(after.body["input"])[-1500:]
    output = outputs[0]["output"]
    assert isinstance(output, list) and [p["type"] for p in output] == ["input_image"], output
    head, data = output[0]["image_url"].split(",", 1)
    assert head == "data:image/png;base64"
    assert base64.b64decode(data) == png.read_bytes()
    assert _images(after.body["input"]) == output  # the only image in the request
    _assert_image_counted(vlm_server.url, after)
    assert run.returncode == 0, run.describe()
