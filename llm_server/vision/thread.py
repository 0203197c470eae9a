"""The one thread of a vision model's MLX calls."""

from __future__ import annotations

import atexit
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class VisionThread:
    """The one thread that makes every MLX call of the vision side (a daemon: it never holds
    the process open). When it stops (`stop`, also at exit) its MLX streams are finished and
    freed, as the engine's thread does at its end: a CPU thread that ended without that
    aborted the process at exit about one run in two."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name="llm-vision", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the thread; its result, or its exception raised here."""
        if not self._thread.is_alive():
            raise RuntimeError("the vision thread has stopped")
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future.result()

    def stop(self, timeout: float = 10.0) -> None:
        atexit.unregister(self.stop)
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout)

    def _main(self) -> None:
        from llm_server.engines.forward.kernels import GenericKernels

        try:
            while (job := self._jobs.get()) is not None:
                future, fn, args = job
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - the caller's to raise
                    future.set_exception(exc)
        finally:
            GenericKernels.thread_exit()  # plain MLX ops here: the generic set's end
