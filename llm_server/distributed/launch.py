"""Joining the group and taking a rank's role: rank 0 serves, the others follow.

`llm-server --distributed ring ...` under `mlx.launch` (which sets each rank's hostfile and
rank), or `llm-server --hosts HOSTFILE ...`, which starts `mlx.launch` itself with the installed
`llm-server` as the program on every host. A watchdog on rank 0 ends the process (non-zero) when a call to
the group has not returned in `--distributed-timeout` seconds: a dead or hung rank never
leaves the server hanging. An idle rank 0 broadcasts a heartbeat every quarter of that timeout,
and a follower that hears nothing from rank 0 for twice the timeout exits (non-zero) too.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llm_server.settings import ServerSettings

log = logging.getLogger("llm_server.distributed")

EXIT_GROUP_LOST = 3
# the program mlx.launch starts on each host with this interpreter: the installed `llm-server`
# (a Python script beside it; each host has the same environment at the same path)
RANK_PROGRAM = Path(sys.executable).with_name("llm-server")


def join(backend: str):
    """This rank's `mx.distributed` group (strict: a missing backend is an error)."""
    import mlx.core as mx

    try:
        group = mx.distributed.init(strict=True, backend=backend)
    except (RuntimeError, ValueError) as exc:
        raise SystemExit(
            f"llm-server: --distributed {backend}: {exc} (start every rank with mlx.launch, "
            "or use --hosts HOSTFILE)"
        ) from None
    log.info("rank %d of %d (%s)", group.rank(), group.size(), backend)
    return group


def build_engine(settings: ServerSettings, model_path: Path):
    """The rank's sharded engine (`settings.engine.group`), as rank 0's service loads its own."""
    from llm_server.engines.mlx.engine import MLXEngine

    return MLXEngine(model_path, settings.engine)


def wrap(engine, settings: ServerSettings):
    """Rank 0's engine: broadcast each call, and watch that the group answers within
    `settings.distributed_timeout`."""
    from llm_server.distributed.engine import LockstepEngine
    from llm_server.distributed.transport import GroupTransport

    group, timeout = settings.engine.group, settings.distributed_timeout
    lockstep = LockstepEngine(
        engine, GroupTransport(group), group.size(), settings.distributed, settings.engine.parallel
    )
    lockstep.on_lost = shut_down
    watch(lockstep, timeout)
    beat(lockstep, timeout / 4)
    return lockstep


LOST: list[str] = []  # why the group was lost, once it was (the CLI then exits non-zero)
SERVICES: list = []  # rank 0's service (attach): its requests are failed when a step hangs


def attach(service) -> None:
    SERVICES.append(service)


def shut_down(reason: str, hung: bool = False, grace: float = 5.0) -> None:
    """The group is gone: drain the server (new requests get 503) and exit non-zero; a
    server stuck in a hung collective is ended after `grace` seconds."""
    LOST.append(reason)
    if hung:  # the scheduler thread cannot fail its requests: answer them from here
        for service in SERVICES:
            service.scheduler.fail_all(reason)
    os.kill(os.getpid(), signal.SIGTERM)
    timer = threading.Timer(grace, _exit_now)
    timer.daemon = True
    timer.start()


def _exit_now() -> None:
    log.error("%s; exiting", LOST[0] if LOST else "the distributed group was lost")
    sys.stderr.flush()
    os._exit(EXIT_GROUP_LOST)


def watch(engine, timeout: float) -> threading.Thread:
    """Mark the group lost when a call of `engine` has not returned in `timeout` seconds."""

    def loop() -> None:
        while engine.lost is None:
            time.sleep(min(1.0, timeout / 4))
            since = engine.busy_since
            if since is not None and time.monotonic() - since > timeout:
                waited = time.monotonic() - since
                engine.lose(f"no answer for {waited:.0f} s (a rank died or hangs)", hung=True)
                return

    thread = threading.Thread(target=loop, name="group-watchdog", daemon=True)
    thread.start()
    return thread


def beat(engine, idle: float) -> threading.Thread:
    """Have `engine` broadcast a heartbeat whenever it sent nothing for `idle` seconds."""

    def loop() -> None:
        while engine.lost is None and not engine.stopped:
            time.sleep(idle / 4)
            engine.heartbeat(idle)

    thread = threading.Thread(target=loop, name="group-heartbeat", daemon=True)
    thread.start()
    return thread


FIRST_CALL_GRACE = 300.0  # seconds a follower waits for rank 0's first call (its load)


def watch_rank_zero(heard, silence: float, rank: int) -> threading.Thread:
    """End this follower (EXIT_GROUP_LOST) when rank 0 has been silent for `silence` seconds
    (`FIRST_CALL_GRACE` before its first call): rank 0 died or hangs, and the follower's
    collective would wait for it forever."""

    def loop() -> None:
        while True:
            time.sleep(min(1.0, silence / 4))
            if heard.silent_for() > (silence if heard.ever else max(silence, FIRST_CALL_GRACE)):
                log.error(
                    "rank %d: nothing from rank 0 for %.0f s (it died or hangs); exiting",
                    rank,
                    heard.silent_for(),
                )
                sys.stderr.flush()
                os._exit(EXIT_GROUP_LOST)
                return  # (os._exit does not return; a test's stand-in does)

    thread = threading.Thread(target=loop, name="rank-zero-watchdog", daemon=True)
    thread.start()
    return thread


def follow_main(settings: ServerSettings, model_path: Path) -> int:
    """A follower rank (of `settings.engine.group`): load the shard, run rank 0's calls until
    it stops (0), or until rank 0 is gone (EXIT_GROUP_LOST)."""
    from llm_server.distributed.engine import BACKEND_ERRORS
    from llm_server.distributed.follower import Heard, follow
    from llm_server.distributed.transport import GroupTransport

    group = settings.engine.group
    engine = build_engine(settings, model_path)
    heard = Heard()  # rank 0 loads its shard meanwhile: the silence counts from here
    watch_rank_zero(heard, 2 * settings.distributed_timeout, group.rank())
    try:
        count = follow(engine, GroupTransport(group), heard)
    except Exception as exc:
        if not any(tag in str(exc) for tag in BACKEND_ERRORS):
            raise
        log.error("rank %d: the group was lost (%s); exiting", group.rank(), exc)
        return EXIT_GROUP_LOST
    log.info("rank %d: rank 0 stopped after %d calls", group.rank(), count)
    return 0


def launch_hosts(argv: list[str], hostfile: str, backend: str) -> int:
    """Re-run this command on every host of `hostfile` through `mlx.launch`."""
    import subprocess

    rest, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--hosts":
            skip = True
        elif not arg.startswith("--hosts="):
            rest.append(arg)
    if "--distributed" not in rest and not any(a.startswith("--distributed=") for a in rest):
        rest += ["--distributed", backend]
    launcher = Path(sys.executable).with_name("mlx.launch")
    cmd = [str(launcher), "--backend", backend, "--hostfile", hostfile]
    cmd += ["--python", sys.executable, str(RANK_PROGRAM), *rest]
    return subprocess.call(cmd)
