"""A local stand-in for the Hugging Face hub's HTTP API: one model repository, enough for
huggingface_hub's snapshot_download (revision info, tree listing, resolve HEAD/GET)."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from pathlib import Path
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _handler(repo_id: str, folder: Path):
    files = {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file()}

    class Hub(http.server.BaseHTTPRequestHandler):
        def _json(self, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _file(self, name: str, head: bool) -> None:
            data = files[name]
            self.send_response(200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not head:
                self.wfile.write(data)

        def _route(self, head: bool) -> None:
            path = unquote(urlparse(self.path).path)
            api = f"/api/models/{repo_id}/"
            resolve = f"/{repo_id}/resolve/"
            if path.startswith(api + "revision/"):
                siblings = [{"rfilename": n} for n in files]
                self._json({"id": repo_id, "sha": COMMIT, "siblings": siblings})
            elif path.startswith(api + "tree/"):
                self._json(
                    [
                        {
                            "type": "file",
                            "path": n,
                            "size": len(d),
                            "oid": hashlib.sha1(d).hexdigest(),
                        }
                        for n, d in files.items()
                    ]
                )
            elif path.startswith(resolve) and path.rsplit("/", 1)[-1] in files:
                self._file(path.rsplit("/", 1)[-1], head)
            else:
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
                self.send_header("Content-Length", "0")
                self.end_headers()

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            self._route(head=False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._route(head=True)

        def log_message(self, *args) -> None:
            pass

    return Hub


class FakeHub:
    """Serve `folder` as the hub repository `repo_id` on a loopback port."""

    def __init__(self, repo_id: str, folder: Path) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(repo_id, folder))
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
