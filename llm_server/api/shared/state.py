"""The application state every handler and middleware shares: the served model and its service
(one model), or the model manager (a registry, `--models FILE`)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from llm_server.service import ModelService

if TYPE_CHECKING:
    from llm_server.models.manager import ModelManager

# ASGI scope keys the model router sets: the service and id the request's `model` resolved to
SERVICE_KEY = "llm_server.service"
MODEL_ID_KEY = "llm_server.model_id"


class AppState:
    """What the handlers share: the service (None until the model is loaded)."""

    def __init__(
        self, service: ModelService | None, model_id: str, manager: ModelManager | None = None
    ) -> None:
        self._service = service
        self.manager = manager  # many models: requests resolve theirs (api/model_router.py)
        self._listeners: list[Callable[[ModelService], None]] = []
        self.model_id = model_id
        self.draining = False
        # awaited first when a drain starts (shutdown.py): the Batch API's runner stops, so its
        # lines in flight are dropped (they run again after the restart) instead of drained
        self.drain_hooks: list[Callable[[], Awaitable[None]]] = []

    @property
    def service(self) -> ModelService | None:
        return self._service

    @service.setter
    def service(self, service: ModelService | None) -> None:
        self._service = service
        if service is not None:
            for listener in self._listeners:
                listener(service)

    def services(self) -> list[ModelService]:
        """Every service that may hold requests: the one, or each model loaded (or loading)."""
        if self.manager is not None:
            return [s.service for s in self.manager.slots.values() if s.service is not None]
        return [self._service] if self._service is not None else []

    def on_service(self, listener: Callable[[ModelService], None]) -> None:
        """Call `listener(service)` now if a service is set, and whenever one is set later."""
        self._listeners.append(listener)
        if self._service is not None:
            listener(self._service)


def scoped_service(scope: dict, state: AppState) -> ModelService | None:
    """The service a request uses: the one its `model` resolved to, else the app's one."""
    return scope.get(SERVICE_KEY) or state.service
