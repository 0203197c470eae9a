"""POST /v1/embeddings with the official openai SDK against live servers.

The tiny llama checkpoint carries sentence-transformers files (mean pooling, Normalize, a query
prompt); vectors are checked against a float64 numpy forward of the same weights
(tests/embedding_reference.py) pooled the declared way.
"""

from __future__ import annotations

import base64
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from llm_server.api.openai.embeddings import MAX_INPUTS
from llm_server.testing.embedding import add_sentence_transformers_files
from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint
from tests.embedding_reference import ReferenceLlama

QUERY_PROMPT = "Instruct: find the capital\nQuery: "
TEXTS = ["The capital of France is Paris.", "Hello", "def main():\n    print('hello world')"]
TOL = 1e-5


@pytest.fixture(scope="module")
def st_model(tmp_path_factory):
    path = build_tiny_checkpoint(tmp_path_factory.mktemp("st") / "tiny-st", TinySpec(arch="llama"))
    return add_sentence_transformers_files(
        path, "mean", True, {"query": QUERY_PROMPT, "document": ""}
    )


@pytest.fixture(scope="module")
def st_server(st_model):
    from llm_server.testing.live import serving

    with serving(st_model, concurrent=2) as srv:
        yield srv


@pytest.fixture(scope="module")
def reference(st_model) -> ReferenceLlama:
    return ReferenceLlama(st_model)


@pytest.fixture
def client(st_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=st_server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def http(st_server):
    with httpx.Client(base_url=st_server.url, timeout=60) as c:
        yield c


def encode(server, text: str) -> list[int]:
    return server.service.tokenizer.encode(text)


def test_float_vectors_match_the_reference_forward(client, st_server, reference):
    model = st_server.state.model_id
    resp = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert resp.object == "list" and resp.model == model
    assert [d.index for d in resp.data] == [0, 1, 2]
    assert all(d.object == "embedding" and len(d.embedding) == 64 for d in resp.data)
    ids = [encode(st_server, t) for t in TEXTS]
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(len(i) for i in ids)
    for d, i in zip(resp.data, ids, strict=True):
        np.testing.assert_allclose(d.embedding, reference.embed(i, "mean", True), atol=TOL)


def test_base64_is_little_endian_float32_of_the_same_vector(client, st_server, http):
    floats = client.embeddings.create(model="default", input=TEXTS[0], encoding_format="float")
    # the SDK asks for base64 when no format is given and decodes it with numpy
    decoded = client.embeddings.create(model="default", input=TEXTS[0])
    assert decoded.data[0].embedding == floats.data[0].embedding
    raw = http.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"})
    assert raw.status_code == 200
    vec = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    assert vec.tolist() == floats.data[0].embedding


def test_dimensions_truncate_then_renormalise(client):
    full = np.array(client.embeddings.create(input=TEXTS[1], model="default").data[0].embedding)
    cut = client.embeddings.create(input=TEXTS[1], model="default", dimensions=16)
    got = np.array(cut.data[0].embedding)
    assert got.shape == (16,)
    np.testing.assert_allclose(got, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)
    assert abs(np.linalg.norm(got) - 1) < 1e-6


def test_token_id_inputs_equal_their_text(client, st_server):
    texts = client.embeddings.create(model="default", input=TEXTS[:2], encoding_format="float")
    ids = [encode(st_server, t) for t in TEXTS[:2]]
    lists = client.embeddings.create(model="default", input=ids, encoding_format="float")
    single = client.embeddings.create(model="default", input=ids[0], encoding_format="float")
    for a, b in zip(texts.data, lists.data, strict=True):
        np.testing.assert_allclose(a.embedding, b.embedding, atol=TOL)
    np.testing.assert_allclose(single.data[0].embedding, texts.data[0].embedding, atol=TOL)
    assert lists.usage.prompt_tokens == sum(len(i) for i in ids)


def test_query_input_type_adds_the_checkpoint_prompt(st_server, http, reference):
    body = {"input": [TEXTS[0]], "encoding_format": "float"}
    query = http.post("/v1/embeddings", json={**body, "input_type": "query"}).json()
    doc = http.post("/v1/embeddings", json={**body, "input_type": "document"}).json()
    ids = encode(st_server, QUERY_PROMPT + TEXTS[0])
    np.testing.assert_allclose(
        query["data"][0]["embedding"], reference.embed(ids, "mean", True), atol=TOL
    )
    assert query["usage"]["prompt_tokens"] == len(ids)
    assert doc["usage"]["prompt_tokens"] == len(encode(st_server, TEXTS[0]))
    bad = http.post("/v1/embeddings", json={"input": [1, 2], "input_type": "query"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input_type"


def test_batched_and_concurrent_equal_alone(client):
    rng = np.random.default_rng(0)
    inputs = [[int(t) for t in rng.integers(0, 300, size=n)] for n in (3, 150, 40, 41, 1, 260)]

    def embed(batch):
        out = client.embeddings.create(model="default", input=batch, encoding_format="float")
        return np.array([d.embedding for d in out.data])

    together = embed(inputs)
    with ThreadPoolExecutor(3) as pool:
        concurrent = np.concatenate(list(pool.map(embed, [inputs[:2], inputs[2:4], inputs[4:]])))
    alone = np.concatenate([embed([i]) for i in inputs])
    np.testing.assert_allclose(together, alone, rtol=0, atol=TOL)
    np.testing.assert_allclose(concurrent, alone, rtol=0, atol=TOL)


LONG = "Paris " * 1100  # over the 1024-token context

BAD = [
    ({}, "input", "'input' is required"),
    ({"input": ""}, "input", "empty string"),
    ({"input": []}, "input", "non-empty"),
    ({"input": ["a", ""]}, "input[1]", "empty string"),
    ({"input": [[1, 2], []]}, "input[1]", "non-empty array of token ids"),
    ({"input": 5}, "input", "must be a non-empty string"),
    ({"input": [1, "a"]}, "input[0]", "must be a non-empty string"),
    ({"input": [{"text": "a"}]}, "input[0]", "must be a non-empty string"),
    ({"input": [1, 99999]}, "input", "outside the vocabulary"),
    ({"input": ["a", LONG]}, "input[1]", "context holds 1024"),
    ({"input": ["a"] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS}"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format", "'float' or 'base64'"),
    ({"input": "a", "dimensions": 0}, "dimensions", "positive integer"),
    ({"input": "a", "dimensions": "8"}, "dimensions", "positive integer"),
    ({"input": "a", "dimensions": True}, "dimensions", "positive integer"),
    ({"input": "a", "dimensions": 65}, "dimensions", "have 64"),
    ({"input": "a", "input_type": "passage"}, "input_type", "'query' or 'document'"),
    ({"input": "a", "model": 3}, "model", "must be a string"),
]


@pytest.mark.parametrize(
    ("body", "param", "text"), BAD, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD)]
)
def test_bad_inputs_get_400_naming_the_field(http, body, param, text):
    resp = http.post("/v1/embeddings", json=body)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert text in err["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="a")


def test_chat_still_works_on_an_embedding_checkpoint(client):
    out = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
    )
    assert out.choices[0].message.content is not None and out.usage.completion_tokens >= 1


@pytest.mark.slow
def test_default_model_embeds(default_model_path):
    """SmolLM2 (no pooling files): last-token, L2-normalised, 576 features; batch == alone."""
    from llm_server.testing.live import serving

    texts = ["The capital of France is Paris.", "Paris is the capital of France.", "2 + 2 = 4"]
    with serving(default_model_path, concurrent=2) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        out = client.embeddings.create(model="default", input=texts, encoding_format="float")
        vecs = np.array([d.embedding for d in out.data])
        alone = np.array(
            [client.embeddings.create(model="default", input=t).data[0].embedding for t in texts]
        )
    assert vecs.shape == (3, 576)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
    np.testing.assert_allclose(vecs, alone, rtol=0, atol=TOL)


def _bare_copy(src, dst):
    """The same weights saved as the bare transformer: no `model.` prefix, no LM head."""
    import shutil

    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(src / "model.safetensors"))
    bare = {k.removeprefix("model."): v for k, v in weights.items() if k != "lm_head.weight"}
    save_file(bare, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_bare_embedding_checkpoint_serves_embeddings_only(st_model, tmp_path, client):
    """A sentence-transformers save (no LM head) starts; chat and completions get a clean 400."""
    from llm_server.testing.live import serving

    want = client.embeddings.create(model="default", input=TEXTS, encoding_format="float")
    with serving(_bare_copy(st_model, tmp_path / "bare")) as srv:
        bare = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        got = bare.embeddings.create(model="default", input=TEXTS, encoding_format="float")
        for a, b in zip(got.data, want.data, strict=True):
            np.testing.assert_allclose(a.embedding, b.embedding, rtol=0, atol=TOL)
        with pytest.raises(openai.BadRequestError) as chat:
            bare.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=2
            )
        assert chat.value.code == "embeddings_only"
        with pytest.raises(openai.BadRequestError, match="embeddings only"):
            bare.completions.create(model="default", prompt="Hi", max_tokens=2)
        with pytest.raises(openai.BadRequestError, match="embeddings only"):
            bare.responses.create(model="default", input="Hi", max_output_tokens=2)
        r = httpx.post(
            srv.url + "/v1/messages",
            json={
                "model": "default",
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "Hi"}],
            },
        )
        assert r.status_code == 400
        assert r.json()["type"] == "error" and "embeddings only" in r.json()["error"]["message"]


class _NoEmbeddingEngine:
    """A real engine without the embedding methods (as the Core ML engine is)."""

    no_embeddings = "the mlx engine does not compute embeddings; serve it with another engine"

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        if name.startswith("embed_"):
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_an_engine_without_embeddings_gets_400(tiny_llama_path):
    from llm_server.engines.mlx.engine import MLXEngine
    from llm_server.testing.live import serving

    factory = lambda: _NoEmbeddingEngine(MLXEngine(tiny_llama_path))  # noqa: E731
    with serving(tiny_llama_path, engine_factory=factory) as srv:
        resp = httpx.post(srv.url + "/v1/embeddings", json={"input": "a"}, timeout=60)
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "embeddings_unavailable"
    assert "does not compute embeddings" in resp.json()["error"]["message"]
