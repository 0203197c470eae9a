"""The application state every handler and middleware shares: the served model and its service."""

from __future__ import annotations

from collections.abc import Callable

from llm_server.service import ModelService


class AppState:
    """What the handlers share: the service (None until the model is loaded)."""

    def __init__(self, service: ModelService | None, model_id: str) -> None:
        self._service = service
        self._listeners: list[Callable[[ModelService], None]] = []
        self.model_id = model_id
        self.draining = False

    @property
    def service(self) -> ModelService | None:
        return self._service

    @service.setter
    def service(self, service: ModelService | None) -> None:
        self._service = service
        if service is not None:
            for listener in self._listeners:
                listener(service)

    def on_service(self, listener: Callable[[ModelService], None]) -> None:
        """Call `listener(service)` now if a service is set, and whenever one is set later."""
        self._listeners.append(listener)
        if self._service is not None:
            listener(self._service)
