"""`llm-server`: load one model and serve it over an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from llm_server.engines.settings import KV_KEEP_ALIVE_S
from llm_server.listen import tcp_socket
from llm_server.model_source import source_or_exit
from llm_server.scheduler.batch import (
    DEFAULT_MEMORY_WAIT_S,
    DEFAULT_PREFILL_TOKENS,
    DEFAULT_SPEC_TOKENS,
    DEFAULT_SPECULATIVE,
    DEFAULT_STEP_TOKENS,
)
from llm_server.settings import (
    DEFAULT_LOAD_WAIT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
)
from llm_server.tools.registry import PARSERS

if TYPE_CHECKING:
    from llm_server.settings import HTTPSettings, ServerSettings

log = logging.getLogger("llm_server")

# Batching costs nothing while one request runs (a step over one row is the same forward), so
# the server batches by default.
DEFAULT_CONCURRENT = 4
VERBS = ("ls", "ps", "pull", "rm", "service")  # subcommands; anything else is the server's flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llm-server", description=__doc__)
    p.add_argument(
        "--model",
        help="model folder (HF/MLX/converted), .gguf file, .mlpackage, or Hugging Face id "
        "ORG/NAME[@REVISION] (downloaded into the HF cache once); "
        "default: the embedded SmolLM2-135M-Instruct",
    )
    p.add_argument(
        "--model-id", help="id reported by /v1/models (default: the hub id or the folder name)"
    )
    p.add_argument(
        "--models",
        metavar="FILE",
        help="serve every model of this registry (TOML [[models]] tables: id, source, ...), each "
        "loaded on the first request naming it (see README, Many models)",
    )
    p.add_argument(
        "--models-from-cache",
        action="store_true",
        help="also register every model in the Hugging Face cache (by its hub id)",
    )
    p.add_argument(
        "--max-memory",
        type=_size,
        metavar="SIZE",
        help="bytes the model (with --models: the loaded models together) may hold: weights, "
        "KV rows and prefix caches as allocated, e.g. 12G; every KV growth asks it first "
        "(least recently used idle models unload, then prefix-cache entries go, to make "
        "room), and a model's default context is what its rows hold within it (default: 3/4 "
        "of physical memory with --models, none with --model)",
    )
    p.add_argument(
        "--idle-unload",
        type=float,
        metavar="SECONDS",
        help="with --models: unload a model idle this long (default: never; a registry entry's "
        "idle_ttl and a request's keep_alive override it)",
    )
    p.add_argument(
        "--load-wait",
        type=float,
        metavar="SECONDS",
        help="with --models: how long a request for a model that does not fit waits for a "
        "loaded model to go idle (then evicts it) before a 503 (default: "
        f"{DEFAULT_LOAD_WAIT_S:g})",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port; 0 picks a free one (default 8080)")
    p.add_argument("--uds", help="serve on this Unix socket instead of TCP")
    p.add_argument(
        "--concurrent-requests",
        type=int,
        default=DEFAULT_CONCURRENT,
        metavar="N",
        help=f"requests decoded together in one batch (default {DEFAULT_CONCURRENT}; "
        "1 serves one request at a time)",
    )
    p.add_argument(
        "--max-queued",
        type=int,
        default=16,
        metavar="M",
        help="requests that may wait for a row before 429 (default 16)",
    )
    p.add_argument(
        "--memory-wait",
        type=float,
        default=DEFAULT_MEMORY_WAIT_S,
        metavar="SECONDS",
        help="seconds a request whose prompt's KV the memory budget refuses waits for room "
        f"before 503 (default {DEFAULT_MEMORY_WAIT_S:g})",
    )
    p.add_argument(
        "--step-tokens",
        type=int,
        default=DEFAULT_STEP_TOKENS,
        metavar="T",
        help="positions per forward, decoding rows included: a newcomer's prompt rides in the "
        f"decode forward in chunks of what is left (default {DEFAULT_STEP_TOKENS}; 0 runs each "
        "prompt whole when it is admitted, stalling the running rows meanwhile)",
    )
    p.add_argument(
        "--prefill-tokens",
        type=int,
        default=DEFAULT_PREFILL_TOKENS,
        metavar="P",
        help="positions per forward when no row is decoding, so a lone long prompt runs in "
        f"larger chunks (default {DEFAULT_PREFILL_TOKENS}; never below --step-tokens; 0: the "
        "whole prompt in one forward)",
    )
    p.add_argument(
        "--speculative",
        default=DEFAULT_SPECULATIVE,
        choices=["ngram", "off"],
        help="speculative decoding: 'ngram' drafts up to --spec-tokens ids by prompt lookup "
        "(the row's last tokens matched in its prompt and output), as many as the measured "
        "step costs and the row's acceptance say pay, and verifies them in the batched "
        "forward; greedy output is unchanged, sampled output keeps its distribution. A "
        "request's 'prediction' drafts in either mode (default %(default)s)",
    )
    p.add_argument(
        "--spec-tokens",
        type=int,
        default=DEFAULT_SPEC_TOKENS,
        metavar="K",
        help=f"most draft ids a row verifies per step (default {DEFAULT_SPEC_TOKENS})",
    )
    p.add_argument(
        "--distributed",
        metavar="BACKEND",
        help="shard the model tensor-parallel over an mx.distributed group (ring, jaccl, mpi or "
        "any; run every rank under mlx.launch, or use --hosts): rank 0 serves HTTP",
    )
    p.add_argument(
        "--hosts",
        metavar="HOSTFILE",
        help="start this command on every host of an mlx.launch hostfile (JSON) with "
        "--distributed (ring unless given)",
    )
    p.add_argument(
        "--pipeline",
        action="store_true",
        help="with --distributed or --hosts: split the layers over the ranks (pipeline "
        "parallel: each rank holds a contiguous slice and its KV) instead of sharding every "
        "layer (tensor parallel); llama, qwen2 and qwen3 models",
    )
    p.add_argument(
        "--distributed-timeout",
        type=float,
        default=20.0,
        metavar="S",
        help="rank 0 answers 503 and exits (status 3) when the group has not answered a step "
        "for S seconds (default 20; raise it for steps that run longer)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "float16", "bfloat16"],
        help="compute dtype (default: float32 on the CPU; on Metal the checkpoint's own "
        "bfloat16/float16, half the memory of float32)",
    )
    p.add_argument(
        "--kv-dtype",
        default=None,
        choices=["float32", "float16", "bfloat16"],
        help="the KV store's dtype (default: the compute dtype on the CPU, float32; on Metal "
        "the checkpoint's own bfloat16/float16); float16 halves the KV memory of float32",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        default=None,
        choices=[8, 4],
        help="quantize the KV store to 8 or 4 bits (mlx-lm's quantized KV cache), a quarter "
        "or an eighth of float32's KV memory plus the groups' scales; not with --kv-dtype",
    )
    p.add_argument(
        "--kv-group-size",
        type=int,
        default=None,
        choices=[32, 64, 128],
        help="values per quantization group of --kv-bits (default 64)",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "mlx", "coreml"],
        help="engine; auto picks coreml for an .mlpackage, else mlx",
    )
    p.add_argument(
        "--prefix-cache-bytes",
        type=_size,
        default=None,
        metavar="BYTES",
        help="bound of the prompt prefix cache, e.g. 512M or 2G (default: the KV of 40,960 "
        "positions, two 20k-token agent conversations, at most an eighth of the memory, at "
        "least 64M; 0 turns it off)",
    )
    p.add_argument(
        "--prefix-cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep prefix cache entries evicted from memory, and at shutdown the resident ones, "
        "in DIR (per model, dtype and kernel set); they are read back on a hit, after restarts too",
    )
    p.add_argument(
        "--prefix-cache-disk-bytes",
        type=_size,
        default=None,
        metavar="BYTES",
        help="bound of --prefix-cache-dir, e.g. 8G (default: 16G, at most half the free space)",
    )
    p.add_argument(
        "--kv-keep-alive",
        type=_seconds,
        default=KV_KEEP_ALIVE_S,
        metavar="SECONDS",
        help="seconds an idle model keeps its KV memory, each finished conversation's tokens "
        "in place, so an agent's next turn reuses its prompt without a copy (default: "
        f"{KV_KEEP_ALIVE_S:g}; 0 gives the memory back as soon as no request runs)",
    )
    p.add_argument(
        "--warm-prompts",
        type=_warm_prompts,
        default=None,
        metavar="FILE",
        help="JSON/JSONL of prompts or chat bodies ({'messages': [...], 'tools': [...]}) "
        "prefilled into the prefix cache at start",
    )
    p.add_argument(
        "--keep-quantized",
        action="store_true",
        help="serve a quantized MLX checkpoint quantized on the CPU too (default: dequantized "
        "to float32 at load when it fits in memory, much faster on the CPU; Metal keeps it "
        "quantized either way)",
    )
    p.add_argument(
        "--compiled-decode",
        default="auto",
        choices=["auto", "on", "off"],
        help="run pure decode steps as compiled MLX graphs (auto: on on the CPU, where their "
        "logits equal the eager forward's bit for bit; off on Metal); off builds every step's "
        "graph eagerly",
    )
    p.add_argument(
        "--chat-template",
        type=_template,
        metavar="FILE",
        help="Jinja chat template replacing the model's (default: its tokenizer_config.json "
        "or chat_template.jinja)",
    )
    p.add_argument("--context-length", type=int, help="cap the context (default: the model's)")
    p.add_argument(
        "--default-max-tokens",
        type=int,
        default=512,
        help="max_tokens when a request gives none (default 512)",
    )
    p.add_argument(
        "--constrained-mode",
        default="batched",
        type=_constrained_mode,
        choices=["batched", "exclusive"],
        help="response_format requests: decode inside the batch with a per-row mask "
        "(batched, default) or each alone to completion while the batch waits (exclusive; "
        "'lease', its old name, is still accepted)",
    )
    p.add_argument(
        "--pooling",
        choices=["last", "mean", "cls"],
        help="/v1/embeddings pooling (default: the checkpoint's sentence-transformers "
        "1_Pooling config, else last-token; vectors are L2-normalised unless the checkpoint's "
        "modules.json has no Normalize module)",
    )
    p.add_argument(
        "--tool-parser",
        choices=list(PARSERS),
        help="the tool-call syntax to parse and constrain (default: detected from the chat "
        "template)",
    )
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="server log level (default info)",
    )
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on /v1/* "
        "(default: env LLM_SERVER_API_KEY; none when unset)",
    )
    p.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="allow browser requests from ORIGIN (repeatable; default: CORS off)",
    )
    p.add_argument(
        "--max-body-size",
        type=_size,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="SIZE",
        help="largest request body, e.g. 64M (default 32M: a few screenshots inline, as agents "
        "resend them every turn); larger gets HTTP 413",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the Batch API keeps its files and batches, which survive restarts "
        "(default: $XDG_DATA_HOME/llm-server, else ~/.local/share/llm-server; on macOS "
        "~/Library/Application Support/llm-server)",
    )
    p.add_argument(
        "--batch-share",
        action="store_true",
        help="Batch API lines keep decoding beside interactive requests in rows nobody waits "
        "for (more batch throughput; interactive steps carry their rows). Default: a batch "
        "yields every row while any interactive request runs, and resumes 0.2 s after the last",
    )
    p.add_argument(
        "--max-file-size",
        type=_size,
        default=DEFAULT_MAX_FILE_BYTES,
        metavar="SIZE",
        help="largest file POST /v1/files takes, e.g. 50M (default 200M); larger gets HTTP 413",
    )
    p.add_argument(
        "--max-images",
        type=int,
        default=DEFAULT_MAX_IMAGES,
        metavar="N",
        help=f"most images one request may carry (default {DEFAULT_MAX_IMAGES}); more gets "
        "HTTP 400",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        metavar="N",
        help=f"largest image, width x height in pixels (default {DEFAULT_MAX_IMAGE_PIXELS:,}, "
        "8K); larger gets HTTP 400, checked from the file's header before anything is decoded",
    )
    p.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="fetch http(s) image URLs a request names (default: off, only data: URLs and "
        "base64 images; a URL gets HTTP 400). file:// and other schemes are always refused",
    )
    p.add_argument(
        "--max-image-bytes",
        type=_size,
        default=DEFAULT_MAX_IMAGE_BYTES,
        metavar="SIZE",
        help="largest image file, inline or fetched, e.g. 5M (default 20M); larger gets HTTP 400",
    )
    p.add_argument(
        "--log-requests",
        metavar="FILE",
        help="append one JSON line per API request to FILE (see README, Replay)",
    )
    p.add_argument(
        "--no-ui",
        action="store_true",
        help="serve no page at / (default: the dashboard and playground, README 'The page')",
    )
    p.add_argument(
        "--replay",
        metavar="FILE",
        help="instead of serving, run the request log FILE through the API in-process "
        "and print a report",
    )
    p.add_argument(
        "--replay-concurrent",
        action="store_true",
        help="with --replay: send every request at once (default: one after another)",
    )
    p.add_argument(
        "--replay-check",
        action="store_true",
        help="with --replay: exit 1 when a deterministic (temperature 0) request's "
        "output differs from the log",
    )
    p.add_argument(
        "--replay-report",
        metavar="FILE",
        help="with --replay: also write the report as JSON to FILE",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, seconds running requests may take to finish before they "
        "are cancelled (default 30); a second SIGTERM exits at once",
    )
    return p


def _size(text: str) -> int:
    """'512M', '2G', '1000000' -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size: {text!r} (use e.g. 512M, 2G or bytes)"
        ) from None


def _seconds(text: str) -> float:
    """A non-negative number of seconds (argparse type)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, e.g. 60 or 0.5, got {text!r}")
    return value


def _warm_prompts(path: str) -> list:
    """--warm-prompts FILE -> its items (see warm_prompts.py)."""
    from llm_server.warm_prompts import load_warm_prompts

    try:
        return load_warm_prompts(path)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _template(path: str) -> str:
    """--chat-template FILE -> the template text."""
    try:
        return Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise argparse.ArgumentTypeError(f"cannot read {path}: {reason}") from None


def _constrained_mode(text: str) -> str:
    """--constrained-mode: 'lease' is the old name of 'exclusive'."""
    return "exclusive" if text == "lease" else text


def validate_args(args: argparse.Namespace) -> None:
    if args.concurrent_requests < 1:
        raise SystemExit("llm-server: --concurrent-requests must be at least 1")
    if args.max_queued < 0:
        raise SystemExit("llm-server: --max-queued must be 0 or more")
    if not args.memory_wait >= 0:
        raise SystemExit("llm-server: --memory-wait must be 0 or more seconds")
    if args.step_tokens < 0:
        raise SystemExit("llm-server: --step-tokens must be 0 (unlimited) or more")
    if args.prefill_tokens < 0:
        raise SystemExit("llm-server: --prefill-tokens must be 0 (unlimited) or more")
    if args.spec_tokens < 0:
        raise SystemExit("llm-server: --spec-tokens must be 0 or more")
    if not 0 <= args.port <= 65535:
        raise SystemExit("llm-server: --port must be between 0 and 65535")
    if args.max_body_size < 1:
        raise SystemExit("llm-server: --max-body-size must be at least 1 byte")
    if args.max_file_size < 1:
        raise SystemExit("llm-server: --max-file-size must be at least 1 byte")
    if args.max_images < 0:
        raise SystemExit("llm-server: --max-images must be 0 (no images) or more")
    if args.max_image_pixels < 1:
        raise SystemExit("llm-server: --max-image-pixels must be at least 1")
    if args.max_image_bytes < 1:
        raise SystemExit("llm-server: --max-image-bytes must be at least 1 byte")
    if args.pipeline and not (args.distributed or args.hosts):
        raise SystemExit("llm-server: --pipeline needs --distributed BACKEND or --hosts HOSTFILE")
    if args.models or args.models_from_cache:
        if args.model or args.replay or args.distributed or args.hosts:
            raise SystemExit(
                "llm-server: --models serves a registry; it does not combine with --model, "
                "--replay, --distributed or --hosts"
            )
    elif args.idle_unload is not None or args.load_wait is not None:
        raise SystemExit("llm-server: --idle-unload and --load-wait need --models FILE")
    if args.load_wait is not None and args.load_wait < 0:
        raise SystemExit("llm-server: --load-wait must be 0 or more seconds")
    replay_only = args.replay_concurrent or args.replay_check or args.replay_report
    if replay_only and not args.replay:
        raise SystemExit(
            "llm-server: --replay-concurrent, --replay-check and --replay-report need --replay FILE"
        )


def _settings(args: argparse.Namespace) -> ServerSettings:
    """The process's settings (one line on stderr for a value out of range)."""
    from llm_server.settings import ServerSettings

    try:
        return ServerSettings.from_args(args)
    except ValueError as exc:
        raise SystemExit(f"llm-server: {exc}") from None


def _serve_models(args: argparse.Namespace) -> int:
    """The many-model daemon: the registry, then serving until stopped."""
    from llm_server.models.registry import RegistryError, check_unique, load_registry
    from llm_server.native.blas import check_blas

    check_blas()
    try:
        entries = load_registry(args.models) if args.models else []
        if args.models_from_cache:
            from llm_server.models.registry import cached_entries

            entries += cached_entries(entries)
            check_unique(entries, "the registry and the Hugging Face cache")
    except RegistryError as exc:
        raise SystemExit(f"llm-server: {exc}") from None
    if not entries:
        raise SystemExit("llm-server: no models to serve (the Hugging Face cache is empty)")
    settings = _settings(args)
    sock, url = _bind(settings.http)
    from llm_server.server import run_models_server

    return asyncio.run(
        run_models_server(
            settings, entries, sock, url, args.max_memory, args.idle_unload, args.load_wait
        )
    )


def _bind(http: HTTPSettings) -> tuple[socket.socket, str]:
    if http.uds:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(http.uds)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(http.uds)
        return sock, f"unix:{http.uds}"
    family = socket.AF_INET6 if ":" in http.host else socket.AF_INET
    sock = tcp_socket(family)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((http.host, http.port))
    except OSError as exc:
        raise SystemExit(
            f"llm-server: cannot bind {http.host}:{http.port}: {exc.strerror}"
        ) from None
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    return sock, f"http://{shown}:{port}"


def main(argv: list[str] | None = None) -> None:
    from llm_server.native.blas import ensure_fast_blas

    ensure_fast_blas()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in VERBS:  # llm-server ls | ps | pull | rm | service ...
        from llm_server.models.commands import run_verb

        sys.exit(run_verb(argv))
    args = build_parser().parse_args(argv)
    validate_args(args)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    for client in ("httpx", "httpx2"):  # one line per hub request is noise, not news
        logging.getLogger(client).setLevel(max(logging.WARNING, logging.root.level))
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from llm_server.native.blas import active_blas, check_blas

    if args.hosts:
        from llm_server.distributed.launch import launch_hosts

        sys.exit(launch_hosts(argv, args.hosts, args.distributed or "ring"))
    if args.models or args.models_from_cache:
        sys.exit(_serve_models(args))
    source = source_or_exit(args.model)  # before any log line: a bad --model is one line on stderr
    check_blas()  # wrong products: one re-exec with the fallback BLAS (Linux), else a warning
    log.info("BLAS: %s", active_blas())
    model_path = source.path
    if args.model_id is None:
        args.model_id = source.model_id
    settings = _settings(args)
    if args.distributed:
        from llm_server.distributed import launch

        settings = settings.in_group(launch.join(args.distributed))
        if settings.engine.group.rank() != 0:  # a follower: no HTTP, rank 0's calls only
            sys.exit(launch.follow_main(settings, model_path))
    if args.replay:
        from llm_server.server import run_replay

        replay = (args.replay, args.replay_concurrent, args.replay_check, args.replay_report)
        sys.exit(asyncio.run(run_replay(settings, model_path, *replay)))
    sock, url = _bind(settings.http)
    from llm_server.server import run_server

    code = asyncio.run(run_server(settings, model_path, sock, url))
    if settings.engine.group is not None:
        from llm_server.distributed.launch import EXIT_GROUP_LOST, LOST

        code = EXIT_GROUP_LOST if LOST else code
    sys.exit(code)
