"""The operator's image limits (issue 49): --allow-image-urls fetches http(s) images within
--max-image-bytes and a timeout, --max-images and --max-image-pixels bound a request; each
refusal a 400 naming the field. Against a local HTTP server started by the test."""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
from pathlib import Path

import httpx
import pytest

from llm_server.settings import ImageLimits, ServerSettings
from tests.api.helpers import assert_openai_error
from tests.api.image_files import assert_anthropic_error, chat_body, data_url, png

CHAT, MESS = "/v1/chat/completions", "/v1/messages"

LIMITS = ImageLimits(
    max_images=2, max_pixels=10_000, max_bytes=2_000, allow_urls=True, url_timeout=1.0
)
SLOW_S = 3.0  # the slow route answers after this many seconds (over LIMITS.url_timeout)
FIELD = "messages[0].content[1].image_url"


class _Images(http.server.BaseHTTPRequestHandler):
    routes = {
        "/ok.png": png(),
        "/big.png": b"\x89PNG" + b"\0" * 5_000,  # over the byte cap, declared
        "/stream.png": b"\x89PNG" + b"\0" * 5_000,  # over the byte cap, no content-length
    }

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/slow.png":
            time.sleep(SLOW_S)
        if self.path == "/to-file":
            self.send_response(302)
            self.send_header("Location", "file:///etc/passwd")
            self.end_headers()
            return
        body = self.routes.get(self.path)
        if body is None and self.path != "/slow.png":
            self.send_error(404)
            return
        body = body or png()
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        if self.path != "/stream.png":
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        with contextlib.suppress(OSError):  # the server under test gave up (the timeout)
            self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def images_url():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def limited(tiny_model_path: Path):
    from llm_server.testing.live import serving

    with (
        serving(tiny_model_path, concurrent=2, app_options={"images": LIMITS}) as srv,
        httpx.Client(base_url=srv.url, timeout=60) as client,
    ):
        yield client


def _refused(client: httpx.Client, url: str, field: str = FIELD) -> str:
    return assert_openai_error(client.post(CHAT, json=chat_body(url)), 400, field)["message"]


def test_a_fetched_image_is_decoded_then_refused_by_a_text_model(limited, images_url):
    assert "reads text only" in _refused(limited, images_url + "/ok.png")
    source = {"type": "url", "url": images_url + "/ok.png"}
    body = {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image", "source": source}]}]}  # fmt: skip
    assert_anthropic_error(
        limited.post(MESS, json=body), 400, "messages[0].content[0].source.url", "reads text only"
    )


def test_the_byte_cap_holds_with_and_without_content_length(limited, images_url):
    for path in ("/big.png", "/stream.png"):
        message = _refused(limited, images_url + path)
        assert "--max-image-bytes" in message and "2,000" in message
    big = data_url(b"\x89PNG" + b"\0" * 5_000)
    assert "--max-image-bytes" in _refused(limited, big)  # inline files too


def test_the_timeout_holds(limited, images_url):
    start = time.monotonic()
    assert "took longer than 1 s" in _refused(limited, images_url + "/slow.png")
    assert time.monotonic() - start < SLOW_S


def test_errors_redirects_and_schemes(limited, images_url):
    assert "HTTP 404" in _refused(limited, images_url + "/missing.png")
    assert "failed" in _refused(limited, images_url + "/to-file")  # never follows to file://
    assert "file://" in _refused(limited, "file:///etc/passwd")  # even with URLs allowed
    assert "scheme 'ftp'" in _refused(limited, "ftp://example.com/a.png")


def test_max_images_and_max_pixels(limited):
    parts = [{"type": "image_url", "image_url": {"url": data_url(png())}}] * 3
    body = {"model": "default", "messages": [{"role": "user", "content": parts}]}
    err = assert_openai_error(
        limited.post(CHAT, json=body), 400, "messages[0].content[2].image_url"
    )
    assert "at most 2 per request" in err["message"]
    message = _refused(limited, data_url(png((200, 200))))
    assert "200x200 = 40,000 pixels" in message and "10,000" in message


def test_the_flags_reach_the_settings():
    from llm_server.cli import build_parser

    args = build_parser().parse_args([])
    assert ServerSettings.from_args(args).http.images == ImageLimits()
    assert ImageLimits().max_images == 8 and ImageLimits().max_pixels == 33_177_600
    assert ImageLimits().max_bytes == 20 * 1024 * 1024 and not ImageLimits().allow_urls
    argv = [
        "--max-images",
        "3",
        "--max-image-pixels",
        "1000",
        "--allow-image-urls",
        "--max-image-bytes",
        "5M",
    ]
    images = ServerSettings.from_args(build_parser().parse_args(argv)).http.images
    assert images == ImageLimits(max_images=3, max_pixels=1000, max_bytes=5 << 20, allow_urls=True)
