"""Start `llm-server --distributed ring` as N processes on localhost (tests, benchmarks).

What `mlx.launch --backend ring -n N` does, by hand: a hostfile of 127.0.0.1 entries and
`MLX_RANK` / `MLX_HOSTFILE` per process, so the caller holds every rank's process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

READY = "llm-server ready on "
CODE = "import sys; from llm_server.cli import main; main(sys.argv[1:])"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@dataclass
class Ranks:
    """The rank processes, rank 0's URL and everything they printed."""

    procs: list[subprocess.Popen]
    url: str = ""
    output: list[list[str]] = field(default_factory=list)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait(10)

    def text(self) -> str:
        return "\n".join(f"--- rank {i}\n" + "".join(o) for i, o in enumerate(self.output))


def start_ranks(model: Path, workdir: Path, n: int = 2, args: tuple[str, ...] = ()) -> Ranks:
    """Start n ranks serving `model`; returns once rank 0 is ready (raises if it is not)."""
    hostfile = workdir / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
    cmd = [sys.executable, "-c", CODE, "--model", str(model), "--port", "0"]
    cmd += ["--distributed", "ring", "--log-level", "info", *args]
    ranks = Ranks([])
    ready = threading.Event()
    for rank in range(n):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile)}
        env["PYTHONUNBUFFERED"] = "1"
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        lines: list[str] = []
        ranks.procs.append(proc)
        ranks.output.append(lines)

        def read(proc=proc, lines=lines, rank=rank) -> None:
            for line in proc.stdout:
                lines.append(line)
                if rank == 0 and line.startswith(READY):
                    ranks.url = line[len(READY) :].strip()
                    ready.set()
            if rank == 0:
                ready.set()

        threading.Thread(target=read, daemon=True).start()
    if not ready.wait(120) or not ranks.url:
        ranks.stop()
        raise RuntimeError("the ranks did not start:\n" + ranks.text())
    return ranks
