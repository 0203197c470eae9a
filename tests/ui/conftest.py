"""The page in a real browser: Debian's headless Chromium driven by selenium, against live
servers on the tiny checkpoints. Screenshots go to build/ui-screenshots (the CI artifacts);
LLM_SERVER_UI_DOCS=1 also writes them over docs/ui/*.png (README shows those)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from llm_server.models.registry import ModelEntry
from llm_server.testing.managed import ManagedServer
from llm_server.testing.tiny import TinySpec, build_tiny_checkpoint

ROOT = Path(__file__).parents[2]
ARTIFACTS = Path(os.environ.get("LLM_SERVER_UI_ARTIFACTS", ROOT / "build" / "ui-screenshots"))
DOCS = ROOT / "docs" / "ui"
WINDOW = (1280, 800)
WAIT = 30.0  # seconds a condition on the page may take (a model load on 2 busy cores)
KEY = "test-ui-key"
BUDGET = 200 << 20  # bytes


def _chromium() -> tuple[str, str] | None:
    """(browser, driver) from the system's packages (Debian: chromium, chromium-driver)."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.fixture(scope="session")
def browser() -> Iterator:
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium: pip install -e .[dev]")
    found = _chromium()
    if found is None:
        pytest.skip("no chromium and chromedriver on PATH (make test installs them on Debian)")
    options = webdriver.ChromeOptions()
    options.binary_location = found[0]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={WINDOW[0]},{WINDOW[1]}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(found[1]))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="session")
def ui_models(tmp_path_factory: pytest.TempPathFactory) -> list[ModelEntry]:
    """Two tiny checkpoints registered as a `--models` daemon would hold them, and a third
    entry whose folder is missing (its load fails)."""
    root = tmp_path_factory.mktemp("ui-models")
    specs = {"alpha": TinySpec(arch="qwen3", seed=1), "beta": TinySpec(arch="llama", seed=2)}
    entries = [
        ModelEntry(id=name, source=str(build_tiny_checkpoint(root / name, spec)))
        for name, spec in specs.items()
    ]
    return [*entries, ModelEntry(id="broken", source=str(root / "missing"))]


@pytest.fixture(scope="module")
def daemon(ui_models: list[ModelEntry]) -> Iterator[ManagedServer]:
    """A many-models server (no key) with 2 rows per model, within a budget the two tiny
    models fill to about two thirds (each counts ~65 MB, mostly its prefix cache's)."""
    with ManagedServer(ui_models, budget=BUDGET, concurrent=2) as srv:
        yield srv


@pytest.fixture(scope="module")
def keyed_daemon(ui_models: list[ModelEntry]) -> Iterator[ManagedServer]:
    with ManagedServer(ui_models, api_key=KEY) as srv:
        yield srv


@pytest.fixture
def wait() -> Callable:
    def until(condition: Callable[[], object], what: str, timeout: float = WAIT):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = condition()
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")

    return until


def screenshot(driver, name: str) -> Path:
    """Save the window as ARTIFACTS/<name>.png (and docs/ui/<name>.png when asked)."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    driver.save_screenshot(str(path))
    if os.environ.get("LLM_SERVER_UI_DOCS") == "1":
        DOCS.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, DOCS / f"{name}.png")
    return path
