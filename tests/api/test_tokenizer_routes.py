"""/tokenize, /detokenize, /tokenizer_info in the shape lm-eval's RemoteTokenizer reads."""

from __future__ import annotations


def test_tokenize_detokenize_round_trip(http, server):
    tok = server.service.tokenizer
    text = "Hello, world"
    resp = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert resp["tokens"] == tok.encode(text, add_special_tokens=False)
    assert resp["count"] == len(resp["tokens"])
    assert resp["max_model_len"] == server.service.context_length
    assert resp["token_strs"] == tok.token_strings(resp["tokens"])
    assert http.post("/detokenize", json={"tokens": resp["tokens"]}).json() == {"prompt": text}


def test_tokenize_messages_matches_chat_usage(http, server):
    messages = [{"role": "user", "content": "hi there"}]
    ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert len(ids) == chat["usage"]["prompt_tokens"]


def test_tokenizer_info_has_what_remote_tokenizer_reads(http, server):
    info = http.get("/tokenizer_info").json()
    hf = server.service.tokenizer.hf
    assert info["eos_token"] == hf.eos_token == "<|im_end|>"
    assert info["bos_token"] == hf.bos_token
    assert info["pad_token"] == hf.pad_token
    assert info["chat_template"] == hf.chat_template
    assert info["name_or_path"] == server.state.model_id
    # RemoteTokenizer.eos_token_id encodes the eos string without special tokens: one id.
    ids = http.post(
        "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}
    ).json()
    assert ids["tokens"] == [info["eos_token_id"]]
