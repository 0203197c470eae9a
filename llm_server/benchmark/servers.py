"""Start and stop the servers under test as subprocesses, one at a time, with the same BLAS env.

Every server is stopped on the way out (SIGTERM, then SIGKILL after a grace period), also when
the benchmark fails or is interrupted.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from llm_server.native.blas import preload_env

READY_RE = re.compile(r"llm-server ready on (http://\S+)")
STOP_GRACE_S = 30.0
# peers: servers started from a command the user gives (`llm-benchmark --peer NAME --peer-cmd`)
PEER_LABELS = {
    "llama_server": "llama-server",
    "vllm_mlx": "vllm-mlx",
    "rapid_mlx": "rapid-mlx",
    "llm_server_peer": "llm-server (peer build)",
}
PEER_FIELDS = ("port", "concurrency", "host", "model")  # what a --peer-cmd template may name


class ServerStartError(RuntimeError):
    """A server under test exited or did not become ready; the message points at its log."""


@dataclass(frozen=True)
class ServerSpec:
    """What to launch. `kind` is "ours", "mlx_lm" or a peer kind (PEER_LABELS, started
    from `peer_cmd`); `concurrency` is the load it will get."""

    kind: str
    model: Path
    concurrency: int
    max_queued: int
    start_timeout_s: float = 300.0
    extra_args: tuple[str, ...] = ()  # more llm-server flags (ours only)
    peer_cmd: str | None = None  # a peer's command template ({port}, {concurrency}, {host})


@dataclass(frozen=True)
class RunningServer:
    kind: str
    pid: int
    url: str  # base URL without /v1
    command: tuple[str, ...]
    log_path: Path


def server_env() -> dict[str, str]:
    """The environment both servers get: ours and mlx_lm.server run with the same BLAS preload."""
    env = preload_env()
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def free_port() -> int:
    """A loopback port that was free a moment ago (mlx_lm.server cannot pick its own)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_for(spec: ServerSpec, port: int | None = None) -> list[str]:
    """argv for a server. mlx_lm.server keeps its batching defaults (decode 32, prompts 8)."""
    if spec.kind == "ours":
        return [
            sys.executable, "-c", "from llm_server.cli import main; main()",
            "--model", str(spec.model), "--port", "0",
            "--concurrent-requests", str(spec.concurrency),
            "--max-queued", str(spec.max_queued), "--log-level", "warning", *spec.extra_args,
        ]  # fmt: skip
    if spec.kind == "mlx_lm":
        return [
            sys.executable, "-m", "mlx_lm", "server", "--model", str(spec.model),
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING",
        ]  # fmt: skip
    if spec.kind == "mlx_vlm":  # the vision workload's peer (mlx-vlm's own server)
        return [
            sys.executable, "-m", "mlx_vlm.server", "--model", str(spec.model),
            "--host", "127.0.0.1", "--port", str(port),
        ]  # fmt: skip
    if spec.kind in PEER_LABELS:
        if spec.peer_cmd is None:
            raise ValueError(f"{PEER_LABELS[spec.kind]} needs a command (--peer-cmd)")
        return peer_command(spec.peer_cmd, port, spec.concurrency, spec.model)
    raise ValueError(f"unknown server kind {spec.kind!r} (expected 'ours', 'mlx_lm' or a peer)")


def peer_command(
    template: str, port: int | None, concurrency: int, model: Path | None = None
) -> list[str]:
    """argv of a peer from its template, e.g. `llama-server -m F32.gguf --port {port} -np
    {concurrency} -t 2` ({model}: the benchmark's model folder); ValueError naming what is
    wrong with the template."""
    if "{port}" not in template:
        raise ValueError("--peer-cmd must contain {port} (the benchmark picks a free port)")
    try:
        argv = [
            a.format(port=port, concurrency=concurrency, host="127.0.0.1", model=model)
            for a in shlex.split(template)
        ]
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(
            f"--peer-cmd: {exc!r}; it may name only {', '.join('{' + f + '}' for f in PEER_FIELDS)}"
        ) from None
    if not argv:
        raise ValueError("--peer-cmd is empty")
    return argv


def _pump(stream, log_file, ready: dict, event: threading.Event) -> None:
    """Copy a child's output to its log; note our ready line when it appears."""
    for line in iter(stream.readline, ""):
        log_file.write(line)
        log_file.flush()
        match = READY_RE.search(line)
        if match and "url" not in ready:
            ready["url"] = match.group(1)
            event.set()
    event.set()  # EOF: the process is gone


def _wait_ours(
    proc: subprocess.Popen, ready: dict, event: threading.Event, spec: ServerSpec
) -> str:
    if not event.wait(spec.start_timeout_s) or "url" not in ready:
        raise ServerStartError(f"llm-server did not print its ready line (exit code {proc.poll()})")
    return ready["url"]


def _wait_health(proc: subprocess.Popen, url: str, spec: ServerSpec) -> str:
    """Poll /health until it answers 200 (llama-server answers 503 while loading); a server
    without /health (404) is ready when /v1/models answers 200."""
    name = PEER_LABELS.get(spec.kind, f"{spec.kind.replace('_', '-')}.server")
    deadline = time.monotonic() + spec.start_timeout_s
    with httpx.Client(trust_env=False, timeout=5.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise ServerStartError(f"{name} exited with code {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                status = client.get(f"{url}/health").status_code
                if status == 200 or (status == 404 and client.get(f"{url}/v1/models").is_success):
                    return url
            time.sleep(0.2)
    raise ServerStartError(f"{name} did not answer /health within {spec.start_timeout_s:.0f} s")


def stop(proc: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> int | None:
    """SIGTERM the server's process group, SIGKILL it after `grace_s`; returns the exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


@contextlib.contextmanager
def running(spec: ServerSpec, log_path: Path) -> Iterator[RunningServer]:
    """Start a server, wait until it answers, yield it, and always stop it afterwards."""
    port = None if spec.kind == "ours" else free_port()
    cmd = command_for(spec, port)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log_file:
        # A new session keeps a terminal's Ctrl-C away from the child: we stop it ourselves.
        proc = subprocess.Popen(
            cmd, env=server_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )  # fmt: skip
        ready: dict[str, str] = {}
        event = threading.Event()
        pump = threading.Thread(
            target=_pump, args=(proc.stdout, log_file, ready, event), daemon=True
        )
        pump.start()
        try:
            try:
                if spec.kind == "ours":
                    url = _wait_ours(proc, ready, event, spec)
                else:
                    url = _wait_health(proc, f"http://127.0.0.1:{port}", spec)
            except ServerStartError as exc:
                raise ServerStartError(f"{exc}; see {log_path}") from None
            yield RunningServer(spec.kind, proc.pid, url, tuple(cmd), log_path)
        finally:
            stop(proc)
            pump.join(5.0)


LLAMA_SERVER_CMD = "{bin} -m {gguf} -t {threads} -tb {threads} -np {slots} -c {ctx} --host {{host}} --port {{port}}"


def add_llama_server_args(p) -> None:
    """The flags of a benchmark that measures llama-server beside ours."""
    p.add_argument("--llama-server", type=Path, help="llama-server binary: measured beside ours")
    p.add_argument("--gguf", type=Path, help="the weights llama-server serves (F32 SmolLM2)")
    p.add_argument("--llama-threads", type=int, default=2)


def llama_server_cmd(p, args, ctx: int, slots: int = 1) -> str | None:
    """The llama-server command template of those flags, `ctx` positions a slot (None without
    --llama-server)."""
    if not args.llama_server:
        return None
    if not args.gguf:
        p.error("--llama-server needs --gguf")
    return LLAMA_SERVER_CMD.format(
        bin=args.llama_server, gguf=args.gguf, threads=args.llama_threads, slots=slots,
        ctx=ctx * slots,
    )  # fmt: skip
