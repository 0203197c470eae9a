"""The page at `/` in headless Chromium: models, loading, the playground's stream, output shown
as text, live charts, the requests list, and the API key."""

from __future__ import annotations

import json
import threading

import httpx
from selenium.webdriver.common.by import By

from .conftest import KEY, screenshot

EVIL = "<script>window.pwned=1</script><img src=x onerror=window.pwned=2>"


def _open(driver, url: str, view: str = "models") -> None:
    driver.get("about:blank")  # a fresh page each time (a new hash alone does not reload)
    driver.get(f"{url}/#{view}")


def _row(driver, model: str):
    rows = driver.find_elements(By.CSS_SELECTOR, f'#models-body tr[data-model="{model}"]')
    return rows[0] if rows else None


def _status(driver, model: str) -> str | None:
    return driver.execute_script(
        "const r = document.querySelector(`#models-body tr[data-model='${arguments[0]}']`);"
        "return r ? r.dataset.status : null;",
        model,
    )


def _severe(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _load(driver, model: str) -> None:
    button = f"//tr[@data-model='{model}']//button[text()='Load']"
    driver.find_element(By.XPATH, button).click()


def test_the_page_loads_without_console_errors_and_lists_the_models(browser, daemon, wait):
    browser.get_log("browser")  # drop what earlier pages logged
    _open(browser, daemon.url)
    wait(lambda: all(_row(browser, m) for m in ("alpha", "beta", "broken")), "the models listed")
    assert _status(browser, "alpha") == "unloaded"
    assert browser.find_element(By.ID, "connection").text == "live"
    for view in ("now", "requests", "playground", "models"):
        browser.find_element(By.CSS_SELECTOR, f'.tab[data-view="{view}"]').click()
        assert browser.find_element(By.ID, f"view-{view}").is_displayed()
    assert _severe(browser) == []


def test_a_one_model_server_shows_its_model_without_load_buttons(
    browser, live_server, tiny_model_path, wait
):
    srv = live_server(tiny_model_path)
    browser.get_log("browser")
    _open(browser, srv.url)
    wait(lambda: _status(browser, srv.state.model_id) == "loaded", "the model listed as loaded")
    assert _row(browser, srv.state.model_id).find_elements(By.TAG_NAME, "button") == []
    assert _severe(browser) == []


def test_loading_a_model_from_the_page_changes_its_status(browser, daemon, wait):
    _open(browser, daemon.url)
    wait(lambda: _status(browser, "beta") == "unloaded", "beta listed as unloaded")
    _load(browser, "beta")
    wait(lambda: _status(browser, "beta") == "loaded", "beta loaded")
    _load(browser, "broken")
    wait(lambda: _status(browser, "broken") == "failed", "broken failed")
    assert "missing" in _row(browser, "broken").find_element(By.CLASS_NAME, "error").text
    text = _row(browser, "beta").text
    assert "loaded" in text and "1024" in text  # its context, once loaded
    width = browser.execute_script(
        "return document.querySelector(\"tr[data-model='beta'] .fill\").style.width"
    )
    assert width not in ("", "0", "0%")  # its bytes against the budget
    assert httpx.get(f"{daemon.url}/v1/models/beta").json()["status"] == "loaded"
    screenshot(browser, "models")


def _send(driver, text: str) -> None:
    box = driver.find_element(By.ID, "chat-input")
    box.clear()
    box.send_keys(text)
    driver.find_element(By.ID, "chat-send").click()


def _answers(driver) -> list[str]:
    return driver.execute_script(
        "return [...document.querySelectorAll('#transcript .assistant .content')]"
        ".map(n => n.textContent)"
    )


def test_a_playground_chat_streams_its_answer_into_the_page(browser, daemon, wait):
    _open(browser, daemon.url, "playground")
    wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#chat-model option"), "the models")
    browser.execute_script("document.getElementById('chat-model').value = 'alpha'")
    browser.find_element(By.ID, "chat-max-tokens").clear()
    browser.find_element(By.ID, "chat-max-tokens").send_keys("48")
    # every change of the answer's text, as the page makes it
    browser.execute_script(
        "window.seen = [];"
        "new MutationObserver(() => {"
        "  const n = [...document.querySelectorAll('#transcript .assistant .content')].pop();"
        "  if (n) window.seen.push(n.textContent.length);"
        "}).observe(document.getElementById('transcript'),"
        "  {childList: true, subtree: true, characterData: true});"
    )
    _send(browser, "Write a short poem about the sea.")
    wait(lambda: "tokens/s" in browser.find_element(By.ID, "chat-stats").text, "the answer")
    stats = browser.find_element(By.ID, "chat-stats").text
    assert "48 answer tokens" in stats
    answer = _answers(browser)[-1]
    assert answer
    seen = [n for n in browser.execute_script("return window.seen") if n]
    assert len(set(seen)) > 3, f"the answer arrived in {len(set(seen))} pieces, not streamed"
    assert seen[-1] == len(answer)
    screenshot(browser, "playground")


def test_model_output_with_markup_is_shown_as_text(browser, daemon, wait):
    """A script tag and an img onerror in the answer stay text: nothing runs, no element."""
    _open(browser, daemon.url, "playground")
    wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#chat-model option"), "the models")
    browser.execute_script("document.getElementById('chat-model').value = 'alpha'")
    browser.find_element(By.ID, "chat-max-tokens").clear()
    browser.find_element(By.ID, "chat-max-tokens").send_keys("200")
    # the answer is forced to EVIL (as a JSON string) by a response_format the test adds
    schema = {"type": "string", "enum": [EVIL]}
    format_ = {"type": "json_schema", "json_schema": {"name": "markup", "schema": schema}}
    _with_fields(browser, {"response_format": format_})
    _send(browser, "Say something with markup.")
    wait(lambda: EVIL in "".join(_answers(browser)), "the answer")
    transcript = browser.find_element(By.ID, "transcript")
    assert transcript.find_elements(By.TAG_NAME, "img") == []
    assert transcript.find_elements(By.TAG_NAME, "script") == []
    assert browser.execute_script("return window.pwned === undefined")
    assert json.loads(_answers(browser)[-1]) == EVIL


def _with_fields(driver, fields: dict) -> None:
    """Add `fields` to the chat requests the page sends (what the playground has no control
    for), so the model's answer takes a shape the test chooses."""
    driver.execute_script(
        "const fields = arguments[0]; const plain = window.fetch;"
        "window.fetch = (url, options) => {"
        "  if (String(url).endsWith('/v1/chat/completions')) {"
        "    const body = {...JSON.parse(options.body), ...fields};"
        "    options = {...options, body: JSON.stringify(body)};"
        "  }"
        "  return plain(url, options);"
        "};",
        fields,
    )


def test_a_tool_call_is_shown_as_a_call(browser, daemon, wait):
    _open(browser, daemon.url, "playground")
    wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#chat-model option"), "the models")
    browser.execute_script("document.getElementById('chat-model').value = 'alpha'")
    browser.find_element(By.ID, "chat-max-tokens").clear()
    browser.find_element(By.ID, "chat-max-tokens").send_keys("200")
    city = {"type": "string", "enum": ["Paris"]}
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": city},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
    _with_fields(browser, {"tools": [tool], "tool_choice": "required"})
    _send(browser, "Weather in Paris?")
    call = wait(lambda: browser.find_elements(By.CSS_SELECTOR, "#transcript .tool-call"), "a call")
    wait(lambda: "tokens/s" in browser.find_element(By.ID, "chat-stats").text, "the end")
    text = call[0].text
    assert text.startswith("call get_weather(") and text.endswith(")")
    assert json.loads(text.removeprefix("call get_weather(")[:-1]) == {"city": "Paris"}


def _load_in_background(url: str, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        body = {"model": "alpha", "prompt": "1, 2, 3,", "max_tokens": 40, "temperature": 0.8}
        with httpx.Client(timeout=60) as client:
            while not stop.is_set():
                client.post(f"{url}/v1/completions", json=body)

    threads = [threading.Thread(target=run, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    return threads


def test_the_now_view_draws_live_charts_under_load(browser, daemon, wait):
    _open(browser, daemon.url, "now")
    stop = threading.Event()
    threads = _load_in_background(daemon.url, stop)
    try:
        tps = wait(
            lambda: (
                (t := browser.find_element(By.ID, "now-tps").text) not in ("", "–")
                and float(t) > 0
                and t
            ),
            "a tokens/s figure",
        )
        assert float(tps) > 0
        wait(
            lambda: browser.find_element(By.ID, "now-ttft").text.startswith(tuple("123456789")),
            "a TTFT percentile",
        )
        wait(
            lambda: browser.execute_script("return samples.filter(p => p.tps > 0).length") >= 8,
            "eight seconds of charts",
        )
        screenshot(browser, "now")
    finally:
        stop.set()
        for t in threads:
            t.join(60)


def test_the_requests_view_lists_a_refused_request_with_its_reason(browser, daemon, wait):
    bad = {"model": "alpha", "messages": [], "max_tokens": 4}
    assert httpx.post(f"{daemon.url}/v1/chat/completions", json=bad).status_code == 400
    _open(browser, daemon.url, "requests")
    row = wait(
        lambda: browser.find_elements(By.CSS_SELECTOR, '#requests-body tr[data-status="400"]'),
        "the 400 listed",
    )[0]
    assert "'messages' must be a non-empty array" in row.text
    assert "/v1/chat/completions" in row.text and "alpha" in row.text
    ok = browser.find_elements(By.CSS_SELECTOR, '#requests-body tr[data-status="200"]')
    assert ok, "the successful requests are listed too"
    screenshot(browser, "requests")


def test_with_a_key_the_page_asks_for_it_once_and_actions_need_it(browser, keyed_daemon, wait):
    url = keyed_daemon.url
    browser.get(f"{url}/")
    browser.execute_script("sessionStorage.clear()")
    browser.get(f"{url}/#models")
    form = wait(lambda: (f := browser.find_element(By.ID, "key-form")).is_displayed() and f, "ask")
    assert _row(browser, "alpha") is None  # nothing shown without the key
    browser.find_element(By.ID, "api-key").send_keys(KEY)
    form.find_element(By.TAG_NAME, "button").click()
    wait(lambda: _row(browser, "alpha"), "models listed with the key")
    browser.refresh()  # asked once: the key is kept for the session
    wait(lambda: _row(browser, "alpha"), "models listed after a reload")
    assert not browser.find_element(By.ID, "key-form").is_displayed()
    _load(browser, "alpha")
    wait(lambda: _status(browser, "alpha") == "loaded", "alpha loaded with the key")
    # without the key, or from another origin, the state-changing routes refuse
    assert httpx.post(f"{url}/v1/models/beta/load").status_code == 401
    assert httpx.get(f"{url}/ui/api/state").status_code == 401
    auth = {"Authorization": f"Bearer {KEY}"}
    cross = httpx.post(
        f"{url}/v1/models/beta/load", headers={**auth, "Origin": "http://elsewhere.example"}
    )
    assert cross.status_code == 403
    assert httpx.get(f"{url}/v1/models/beta", headers=auth).json()["status"] == "unloaded"
