"""The playground shows a thinking model's reasoning apart from its answer (a tiny model with a
`<think>` template, its output scripted by a logits constraint as in tests/api/test_reasoning.py)."""

from __future__ import annotations

import numpy as np
from selenium.webdriver.common.by import By

from llm_server.api.chat import plan as chat_plan
from llm_server.decoding import LogitsConstraint
from llm_server.testing.tiny import THINKING_TEMPLATE, build_tiny_checkpoint

THOUGHT, ANSWER = "The user greets me.", "Hello <b>there</b>."


class Scripted(LogitsConstraint):
    """Allows exactly the next token of a fixed sequence."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.i = ids, 0

    def mask(self, logits: np.ndarray) -> np.ndarray:
        out = np.full_like(logits, -np.inf)
        out[self.ids[self.i]] = 0.0
        return out

    def advance(self, token: int) -> bool:
        self.i += 1
        return False


def test_reasoning_is_shown_apart_from_the_answer(
    browser, live_server, tmp_path, monkeypatch, wait
):
    path = build_tiny_checkpoint(tmp_path / "tiny-think", chat_template=THINKING_TEMPLATE)
    srv = live_server(path)
    tok = srv.service.tokenizer
    texts = (THOUGHT + "</think>", "\n\n" + ANSWER)
    ids = [i for t in texts for i in tok.encode(t, add_special_tokens=False)]
    ids.append(min(tok.eos_token_ids))

    async def scripted(service, chat, thinking_open):
        return Scripted(ids)

    monkeypatch.setattr(chat_plan, "_constraint", scripted)
    browser.get("about:blank")
    browser.get(f"{srv.url}/#playground")
    wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#chat-model option"), "the model")
    box = browser.find_element(By.ID, "chat-input")
    box.send_keys("Hi!")
    browser.find_element(By.ID, "chat-send").click()
    wait(lambda: "tokens/s" in browser.find_element(By.ID, "chat-stats").text, "the answer")
    message = browser.find_element(By.CSS_SELECTOR, "#transcript .assistant")
    reasoning = message.find_element(By.CSS_SELECTOR, ".reasoning div").text
    content = message.find_element(By.CLASS_NAME, "content").text
    assert reasoning.strip() == THOUGHT
    assert content.strip() == ANSWER  # as text: the <b> is not markup
    assert message.find_elements(By.TAG_NAME, "b") == []
