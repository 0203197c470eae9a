"""The page's routes: `/` (the page), `/ui/...` (its files, shipped in the package) and
`/ui/api/state` (the one poll, behind the API key like /v1/*)."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from llm_server.api.shared.errors import APIError
from llm_server.api.shared.recent import RECENT_REQUESTS
from llm_server.api.ui.snapshot import REQUESTS_SHOWN, snapshot

STATIC = Path(__file__).parent / "static"
# the page runs only its own files: no inline script, nothing from another origin, no framing
POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


async def page(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", headers=HEADERS)


async def state(request: Request) -> Response:
    """`?requests=N`: the newest N recent requests (default REQUESTS_SHOWN; the page asks for
    none while its Requests view is hidden)."""
    try:
        shown = int(request.query_params.get("requests", REQUESTS_SHOWN))
    except ValueError:
        raise APIError(400, "'requests' must be an integer", code="invalid_value") from None
    shown = min(max(shown, 0), RECENT_REQUESTS)
    body = snapshot(request.app.state.llm, request.app.state.recent, shown)
    return JSONResponse(body, headers={"Cache-Control": "no-store"})


class _Files(StaticFiles):
    """The page's files with the page's headers."""

    async def get_response(self, path: str, scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(HEADERS)
        return response


UI_ROUTES = [
    Route("/", page, methods=["GET"], include_in_schema=False),
    Route("/ui/api/state", state, methods=["GET"], include_in_schema=False),
    Mount("/ui", app=_Files(directory=STATIC), name="ui"),
]
