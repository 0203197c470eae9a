"""lm-evaluation-harness compatibility of `/v1/completions` scoring (docs/ARCHITECTURE.md C5), no hub.

The full run needs the optional `eval` extra (`pip install -e ".[eval]"`, i.e. lm-eval[api]).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

DATA = Path(__file__).parent / "data" / "lm_eval"
TOL = 1e-4


def score_http(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_lm_eval_request_shape(tiny_model_path, live_server):
    """The exact body lm-eval's local-completions sends for loglikelihood requests."""
    srv = live_server(tiny_model_path, 2)
    ids = srv.service.tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    body = {
        "model": srv.service.config.model_id,
        "prompt": [ids],
        "max_tokens": 1,
        "logprobs": 1,
        "echo": True,
        "temperature": 0,
        "seed": 1234,
    }
    [choice] = score_http(srv.url, body)["choices"]
    lp = choice["logprobs"]
    n = len(ids) + 1  # the prompt plus one generated token, exactly
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
    assert lp["token_logprobs"][-1] == max(lp["top_logprobs"][-1].values())  # greedy token

    [own] = asyncio.run(srv.service.score([ids], 1, True))
    assert lp["token_logprobs"][1:] == pytest.approx(own.token_logprobs[1:], abs=TOL)


def run_lm_eval(url: str, model_id: str, model_path: Path, out: Path) -> list[dict]:
    """`lm_eval --model local-completions` on the local task; returns its logged samples."""
    model_args = ",".join(
        [
            f"model={model_id}",
            f"base_url={url}/v1/completions",
            "tokenizer_backend=huggingface",
            f"tokenizer={model_path}",
            "tokenized_requests=True",
            "num_concurrent=2",
            "max_retries=1",
        ]
    )
    env = {
        **os.environ,
        "HF_HOME": str(out / "hf"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    cmd = [
        sys.executable, "-m", "lm_eval",
        "--model", "local-completions",
        "--model_args", model_args,
        "--tasks", "tiny_mc",
        "--include_path", str(DATA),
        "--batch_size", "4",  # several prompts per request: they score together (C1)
        "--output_path", str(out / "results"),
        "--log_samples",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=DATA, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    [samples] = list((out / "results").rglob("samples_tiny_mc_*.jsonl"))
    return [json.loads(line) for line in samples.read_text().splitlines()]


def test_lm_eval_local_completions_matches_server_scores(tiny_model_path, live_server, tmp_path):
    pytest.importorskip("lm_eval", reason='needs the eval extra: pip install -e ".[eval]"')
    srv = live_server(tiny_model_path, 4)
    samples = run_lm_eval(srv.url, srv.service.config.model_id, tiny_model_path, tmp_path)
    docs = [json.loads(line) for line in (DATA / "tiny_mc.jsonl").read_text().splitlines()]
    assert sorted(s["doc_id"] for s in samples) == list(range(len(docs)))

    checked = 0
    for sample in samples:
        choices = docs[sample["doc_id"]]["choices"]
        args = [sample["arguments"][f"gen_args_{i}"] for i in range(len(choices))]
        for choice, arg, resp in zip(choices, args, sample["resps"], strict=True):
            context, continuation = arg["arg_0"], arg["arg_1"]
            assert continuation == " " + choice
            loglik, is_greedy = float(resp[0][0]), resp[0][1] == "True"  # logged as strings
            # the server's own scoring of the same strings: context alone and context+choice
            body = {"prompt": [context, context + continuation], "echo": True, "logprobs": 1}
            ctx, whole = score_http(srv.url, {**body, "max_tokens": 0})["choices"]
            n_ctx = len(ctx["logprobs"]["tokens"])
            assert whole["logprobs"]["tokens"][:n_ctx] == ctx["logprobs"]["tokens"]
            cont_lps = whole["logprobs"]["token_logprobs"][n_ctx:]
            cont_tops = whole["logprobs"]["top_logprobs"][n_ctx:]
            assert cont_lps, f"{choice!r} added no tokens"
            assert loglik == pytest.approx(sum(cont_lps), abs=TOL)
            greedy = all(
                lp == max(top.values()) for lp, top in zip(cont_lps, cont_tops, strict=True)
            )
            assert is_greedy == greedy
            checked += 1
    assert checked == sum(len(d["choices"]) for d in docs)
