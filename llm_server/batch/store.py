"""The Batch API's durable state under `--data-dir`: uploaded files, batch objects, and each
batch's results, one line per finished input line, appended once.

    files/<file_id>.json     the file object (OpenAI's fields)
    files/<file_id>.jsonl    its content
    batches/<batch_id>.json  the batch object plus the runner's own fields
    batches/<batch_id>.results.jsonl  one output line per finished input line

A results line is appended and fsynced before the line counts as done; on open a torn last line
(a kill in the middle of the write) is cut off, so every input line is in the results at most
once and, once its line is there, never runs again. Objects are replaced whole (write, fsync,
rename), so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from pathlib import Path

FILES = "files"
BATCHES = "batches"


def default_data_dir() -> Path:
    """$XDG_DATA_HOME/llm-server (else ~/.local/share/llm-server; macOS: ~/Library/Application
    Support/llm-server)."""
    xdg = os.environ.get("XDG_DATA_HOME")
    if xdg:
        return Path(xdg) / "llm-server"
    home = Path.home()
    if os.uname().sysname == "Darwin":
        return home / "Library" / "Application Support" / "llm-server"
    return home / ".local" / "share" / "llm-server"


def new_id(prefix: str) -> str:
    """An id such as file-3f2a... or batch_3f2a... (24 hex digits, time first so ids sort)."""
    return f"{prefix}{int(time.time() * 1000):012x}{secrets.token_hex(6)}"


def _write_json(path: Path, obj: dict) -> None:
    # a name per writer: the runner's thread and a request may save one batch at once
    tmp = path.with_suffix(f"{path.suffix}.{threading.get_ident()}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


class Results:
    """One batch's results file: lines appended once, each holding its input line's index."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: dict[int, dict] = {}  # input line index -> its output line
        self._lock = threading.Lock()
        self._recover()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)

    def _recover(self) -> None:
        """Read the finished lines; cut a torn last line (no newline: the write was killed)."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        if end < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
        for raw in data[:end].splitlines():
            try:
                record = json.loads(raw)
            except ValueError:
                continue  # cannot happen with whole lines; skipped rather than fatal
            index = record.get("index")
            if isinstance(index, int) and index not in self.lines:
                self.lines[index] = record["line"]

    def add(self, index: int, line: dict) -> bool:
        """Append the output line of input line `index` (durable on return); False when that
        line is already in (a second answer is dropped: each line once)."""
        with self._lock:
            if index in self.lines:
                return False
            raw = json.dumps({"index": index, "line": line}, ensure_ascii=False) + "\n"
            os.write(self._fd, raw.encode("utf-8"))
            os.fsync(self._fd)
            self.lines[index] = line
            return True

    def close(self) -> None:
        os.close(self._fd)


class BatchStore:
    """Files and batches on disk (created on first use), read back after a restart."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._results: dict[str, Results] = {}
        self._lock = threading.Lock()

    def _dir(self, name: str) -> Path:
        path = self.root / name
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        return path

    # -- files ------------------------------------------------------------------------

    def add_file(self, content: bytes, filename: str, purpose: str, file_id: str | None = None):
        """Store `content` as a new file; returns its file object."""
        file_id = file_id or new_id("file-")
        folder = self._dir(FILES)
        data = folder / f"{file_id}.jsonl"
        tmp = data.with_suffix(f".{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, data)
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": len(content),
            "created_at": int(time.time()),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
        _write_json(folder / f"{file_id}.json", obj)
        return obj

    def file(self, file_id: str) -> dict | None:
        if "/" in file_id or file_id.startswith("."):
            return None
        return _read_json(self.root / FILES / f"{file_id}.json")

    def file_content(self, file_id: str) -> bytes | None:
        if self.file(file_id) is None:
            return None
        try:
            return (self.root / FILES / f"{file_id}.jsonl").read_bytes()
        except OSError:
            return None

    def files(self) -> list[dict]:
        """Every file object, newest first."""
        folder = self.root / FILES
        found = [_read_json(p) for p in folder.glob("*.json")] if folder.is_dir() else []
        return sorted((f for f in found if f), key=lambda f: (f["created_at"], f["id"]))[::-1]

    def delete_file(self, file_id: str) -> bool:
        if self.file(file_id) is None:
            return False
        for suffix in (".json", ".jsonl"):
            (self.root / FILES / f"{file_id}{suffix}").unlink(missing_ok=True)
        return True

    # -- batches ------------------------------------------------------------------------

    def save_batch(self, batch: dict) -> None:
        _write_json(self._dir(BATCHES) / f"{batch['id']}.json", batch)

    def batch(self, batch_id: str) -> dict | None:
        if "/" in batch_id or batch_id.startswith("."):
            return None
        return _read_json(self.root / BATCHES / f"{batch_id}.json")

    def batches(self) -> list[dict]:
        """Every batch object, newest first."""
        folder = self.root / BATCHES
        found = [_read_json(p) for p in folder.glob("*.json")] if folder.is_dir() else []
        return sorted((b for b in found if b), key=lambda b: (b["created_at"], b["id"]))[::-1]

    def results(self, batch_id: str) -> Results:
        """The batch's results (opened once; a torn last line is cut then)."""
        with self._lock:
            if batch_id not in self._results:
                path = self._dir(BATCHES) / f"{batch_id}.results.jsonl"
                self._results[batch_id] = Results(path)
            return self._results[batch_id]

    def close_results(self, batch_id: str) -> None:
        """Close a finished batch's results file (reopened if it is asked for again)."""
        with self._lock:
            results = self._results.pop(batch_id, None)
        if results is not None:
            results.close()

    def close(self) -> None:
        with self._lock:
            for results in self._results.values():
                results.close()
            self._results.clear()
