"""Everything the process is asked for, built once from the command line (`ServerSettings`):
the engine's settings, the service's, the HTTP server's, the disk tier and the warm prompts."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm_server.engines.settings import EngineSettings
from llm_server.service import ServiceConfig

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024  # --max-body-size's default: room for inline images
DEFAULT_MAX_FILE_BYTES = 200 * 1024 * 1024  # --max-file-size's default (OpenAI's bound)
DEFAULT_LOAD_WAIT_S = 60.0  # --load-wait's default: a load waits this long for room (--models)
DEFAULT_MAX_IMAGES = 8  # --max-images' default: images one request may carry
DEFAULT_MAX_IMAGE_PIXELS = 7680 * 4320  # --max-image-pixels' default: 8K (33,177,600 pixels)
DEFAULT_MAX_IMAGE_BYTES = 20 * 1024 * 1024  # --max-image-bytes' default: one image file
DEFAULT_IMAGE_URL_TIMEOUT_S = 10.0  # seconds one http(s) image fetch may take


@dataclass(frozen=True)
class ImageLimits:
    """What the API layer takes in images (api/shared/images.py), per request."""

    max_images: int = DEFAULT_MAX_IMAGES  # more image parts in one request: 400
    max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # width * height; larger: 400, never decoded
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # one image file, inline or fetched; larger: 400
    allow_urls: bool = False  # fetch http(s) image URLs (--allow-image-urls); off: 400
    url_timeout: float = DEFAULT_IMAGE_URL_TIMEOUT_S  # seconds a fetch may take in all


@dataclass(frozen=True)
class HTTPSettings:
    """Where and how the app is served (uvicorn, the app's checks)."""

    host: str = "127.0.0.1"
    port: int = 8080  # 0 picks a free one
    uds: str | None = None  # a Unix socket instead of TCP
    api_key: str | None = None  # None: LLM_SERVER_API_KEY, if set (api/shared/security.py)
    cors_origins: tuple[str, ...] = ()  # browser origins allowed (none: CORS off)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a larger request body gets 413
    drain_timeout: float = 30.0  # seconds running requests may take after SIGTERM
    log_requests: str | None = None  # append one JSON line per API request to this file
    ui: bool = True  # the page at `/` (api/ui/); --no-ui turns it off
    data_dir: Path | None = None  # the Batch API's files and batches (None: the user's data dir)
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES  # a larger upload to /v1/files gets 413
    images: ImageLimits = field(default_factory=ImageLimits)  # --max-images and the others


@dataclass(frozen=True)
class ServerSettings:
    """One model's engine and service behind one HTTP server (each model of a registry gets a
    copy with its entry's overrides: models.daemon.entry_settings)."""

    engine: EngineSettings = field(default_factory=EngineSettings)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    http: HTTPSettings = field(default_factory=HTTPSettings)
    backend: str = "auto"  # "auto" | "mlx" | "coreml" (model_source.pick_backend)
    # the mx.distributed backend the ranks joined through (--distributed; "": one process),
    # and how long rank 0 waits on a step of the group before it gives up
    distributed: str = ""
    distributed_timeout: float = 20.0
    # items of a --warm-prompts file (warm_prompts.py): tokenized by the service, then
    # prefilled by the engine at load (EngineSettings.warm_tokens)
    warm_prompts: tuple[Any, ...] = ()
    # --max-memory with one model: the bytes it may hold (engines/kv/budget.py; None: no
    # budget). The many-models daemon's budget is its manager's
    max_memory: int | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSettings:
        """The settings llm_server.cli's flags ask for (ValueError: a value out of range)."""
        return cls(
            engine=EngineSettings(
                rows=args.concurrent_requests,
                context_length=args.context_length,
                dtype=args.dtype,
                prefix_cache_bytes=args.prefix_cache_bytes,
                keep_quantized=args.keep_quantized,
                compiled_decode={"on": True, "off": False}.get(args.compiled_decode),
                parallel="pipeline" if args.pipeline else "tensor",
                kv_keep_alive=args.kv_keep_alive,
                prefix_cache_dir=args.prefix_cache_dir,
                prefix_cache_disk_bytes=args.prefix_cache_disk_bytes,
                kv_dtype=args.kv_dtype,
                kv_bits=args.kv_bits,
                kv_group_size=args.kv_group_size,
            ),
            service=ServiceConfig(
                model_id=args.model_id or "",
                max_queued=args.max_queued,
                memory_wait=args.memory_wait,
                default_max_tokens=args.default_max_tokens,
                constrained_mode=args.constrained_mode,
                chat_template=args.chat_template,
                tool_parser=args.tool_parser,
                pooling=args.pooling,
                step_tokens=args.step_tokens,
                prefill_tokens=args.prefill_tokens,
                speculative=args.speculative,
                spec_tokens=args.spec_tokens,
                batch_share=args.batch_share,
            ),
            http=HTTPSettings(
                host=args.host,
                port=args.port,
                uds=args.uds,
                api_key=args.api_key,
                cors_origins=tuple(args.cors_origin),
                max_body_bytes=args.max_body_size,
                drain_timeout=args.drain_timeout,
                log_requests=args.log_requests,
                ui=not args.no_ui,
                data_dir=args.data_dir,
                max_file_bytes=args.max_file_size,
                images=ImageLimits(
                    max_images=args.max_images,
                    max_pixels=args.max_image_pixels,
                    max_bytes=args.max_image_bytes,
                    allow_urls=args.allow_image_urls,
                ),
            ),
            backend=args.backend,
            distributed=args.distributed or "",
            distributed_timeout=args.distributed_timeout,
            warm_prompts=tuple(args.warm_prompts or ()),
            max_memory=None if args.models or args.models_from_cache else args.max_memory,
        )

    def replace(self, **fields: Any) -> ServerSettings:
        """A copy with `fields` changed, each named as its part names it (`rows`, `max_queued`,
        `port`, `backend`, ...): the part that has the field gets it."""
        parts: dict[str, dict[str, Any]] = {"engine": {}, "service": {}, "http": {}}
        own = {}
        for name, value in fields.items():
            if name in _FIELDS["self"]:
                own[name] = value
                continue
            part = next((p for p in parts if name in _FIELDS[p]), None)
            if part is None:
                raise TypeError(f"ServerSettings has no field {name!r}")
            parts[part][name] = value
        current = {"engine": self.engine, "service": self.service, "http": self.http}
        for part, changed in parts.items():
            if changed:
                own[part] = dataclasses.replace(current[part], **changed)
        return dataclasses.replace(self, **own)

    def in_group(self, group: Any) -> ServerSettings:
        """This rank's settings once it joined `group` (an mx.distributed group)."""
        return self.replace(group=group)


_FIELDS = {
    "self": {f.name for f in dataclasses.fields(ServerSettings)} - {"engine", "service", "http"},
    "engine": {f.name for f in dataclasses.fields(EngineSettings)},
    "service": {f.name for f in dataclasses.fields(ServiceConfig)},
    "http": {f.name for f in dataclasses.fields(HTTPSettings)},
}
