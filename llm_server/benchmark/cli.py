"""`llm-benchmark`: our server vs mlx_lm.server on one fixed load, plus scoring and the roofline.

Servers run one at a time as subprocesses (ours, then mlx_lm.server, at each concurrency), each
started fresh and stopped before the next. Writes benchmark.json, benchmark.md and benchmark.png.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from pathlib import Path

from llm_server.benchmark.settings import Settings

# --peer name -> the report's server kind
# (`llm-server`: another build of this server, e.g. a previous commit's checkout, side by side)
PEERS = {
    "llama-server": "llama_server",
    "vllm-mlx": "vllm_mlx",
    "rapid-mlx": "rapid_mlx",
    "llm-server": "llm_server_peer",
}
AGENT_MAX_TOKENS = 32  # the agent workload's default: agents' answers are short
FULL = {"concurrency": "1,2,4,8", "requests": 32, "max_tokens": 64, "scoring_prompts": 32}
QUICK = {"concurrency": "1,2", "requests": 4, "max_tokens": 8, "scoring_prompts": 4}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llm-benchmark", description=__doc__)
    p.add_argument("--model", help="model folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--quick", action="store_true",
                   help=f"reduced smoke run: concurrency {QUICK['concurrency']}, {QUICK['requests']} "
                   f"requests, {QUICK['max_tokens']} tokens, {QUICK['scoring_prompts']} scoring prompts")  # fmt: skip
    p.add_argument("--out", help="output folder (default: benchmark-results/<date-time>)")
    p.add_argument(
        "--concurrency", help=f"comma-separated concurrencies (default {FULL['concurrency']})"
    )
    p.add_argument(
        "--requests", type=int, help=f"requests per concurrency (default {FULL['requests']})"
    )
    p.add_argument(
        "--max-tokens", type=int, help=f"new tokens per request (default {FULL['max_tokens']})"
    )
    p.add_argument("--scoring-prompts", type=int,
                   help=f"prompts in the scoring benchmark (default {FULL['scoring_prompts']}; 0 skips it)")  # fmt: skip
    p.add_argument("--step-tokens", type=int,
                   help="our server's --step-tokens (default: the server's; 0 runs each prompt whole "
                   "when admitted, the admission of before issue 17)")  # fmt: skip
    p.add_argument("--workload", choices=["chat", "edit", "agent", "vision"], default="chat",
                   help="chat: the 32 fixed chat prompts (default); edit: prompts asking to "
                   "reproduce a given passage of code or text with one change (speculative decoding); "
                   "agent: multi-turn coding-agent conversations (--agent-log), turn by turn, on "
                   f"every server and peer, TTFT and cached tokens per turn (max tokens {AGENT_MAX_TOKENS}); "
                   "vision: generated images with questions against mlx_vlm.server on a "
                   "vision-language checkpoint (--no-mlx-lm: ours alone)")  # fmt: skip
    p.add_argument("--agent-log", default="codex",
                   help="agent workload: the recorded first request it grows from: codex (default), "
                   "claude-code, or a JSON file with a 'body' (a chat, Responses or Messages request)")  # fmt: skip
    p.add_argument(
        "--agent-turns",
        type=int,
        default=5,
        help="agent workload: turns per conversation (default 5)",
    )
    p.add_argument(
        "--agent-conversations",
        type=int,
        default=1,
        help="agent workload: conversations per server, one after another (default 1)",
    )
    p.add_argument("--speculative", choices=["ngram", "off"],
                   help="our server's --speculative (default: the server's)")  # fmt: skip
    p.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx_lm.server comparison")
    p.add_argument("--batch", type=int, metavar="LINES",
                   help="Batch API: our server alone, interactive tokens/s and TTFT at each "
                   "--concurrency without and with a batch of LINES chat lines running, and the "
                   "batch on an idle server vs the same lines as requests at concurrency 8")  # fmt: skip
    p.add_argument("--peer", choices=sorted(PEERS), action="append",
                   help="also run this server (from --peer-cmd) on the same load, e.g. llama.cpp's "
                   "llama-server; repeat --peer/--peer-cmd pairs for several (agent workload)")  # fmt: skip
    p.add_argument("--peer-cmd", metavar="CMD", action="append",
                   help="the peer's command; {port} (required), {concurrency}, {host} and {model} (the "
                   "model folder) are filled in, e.g. 'llama-server -m smollm2-f32.gguf -t 2 --host {host} "
                   "--port {port} -np {concurrency} -c 8192' or '/venvs/vllm-mlx/bin/vllm-mlx serve {model} "
                   "--port {port}'")  # fmt: skip
    p.add_argument("--rounds", type=int, default=1,
                   help="run every server this many times at each concurrency, the servers' order "
                   "alternating round by round; the report keeps each server's median run and lists "
                   "every round's tokens/s and ratios (default 1; 3 or more on a shared machine)")  # fmt: skip
    p.add_argument("--page-poll", action="store_true",
                   help="also run our server with a client polling what the page at / polls, once a "
                   "second, during the load (server 'ours_page'): the page's overhead")  # fmt: skip
    p.add_argument("--prefix-cache", action="store_true",
                   help="also measure TTFT on a multi-turn workload with the prefix cache on and off")  # fmt: skip
    p.add_argument("--constrained", action="store_true",
                   help="also run the constrained-decoding benchmark (llm_server.benchmark.constrained)")  # fmt: skip
    p.add_argument("--embeddings", action="store_true",
                   help="run only the embeddings benchmark: --embedding-inputs inputs of 20-200 tokens, "
                   "one batched request vs concurrent vs sequential single-input requests")  # fmt: skip
    p.add_argument("--embedding-inputs", type=int, default=64,
                   help="inputs in the embeddings benchmark (default 64)")  # fmt: skip
    return p


def _concurrencies(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise SystemExit(
            f"llm-benchmark: --concurrency takes integers like 1,2,4,8, not {text!r}"
        ) from None
    if not values or values[0] < 1:
        raise SystemExit("llm-benchmark: --concurrency values must be 1 or more")
    return values


def settings_from(args: argparse.Namespace) -> Settings:
    """Resolve defaults (full or quick) and validate; exits with a message on bad input."""
    base = QUICK if args.quick else FULL
    requests = args.requests if args.requests is not None else base["requests"]
    agent = args.workload == "agent"
    max_tokens = args.max_tokens if args.max_tokens is not None else base["max_tokens"]
    if agent and args.max_tokens is None:
        max_tokens = AGENT_MAX_TOKENS
    scoring = args.scoring_prompts if args.scoring_prompts is not None else base["scoring_prompts"]
    if args.step_tokens is not None and args.step_tokens < 0:
        raise SystemExit("llm-benchmark: --step-tokens must be 0 or more")
    if requests < 1 or max_tokens < 1 or scoring < 0:
        raise SystemExit(
            "llm-benchmark: --requests and --max-tokens must be 1 or more, --scoring-prompts 0 or more"
        )
    if args.rounds < 1:
        raise SystemExit("llm-benchmark: --rounds must be 1 or more")
    peers = _peers(args)
    if len(peers) > 1 and not agent:
        raise SystemExit("llm-benchmark: several --peer only with --workload agent")
    if args.agent_turns < 1 or args.agent_conversations < 1:
        raise SystemExit("llm-benchmark: --agent-turns and --agent-conversations must be 1 or more")
    from llm_server.model_source import resolve_model

    model = resolve_model(args.model)  # exits with a message when the folder is unusable
    out = Path(args.out) if args.out else Path("benchmark-results") / time.strftime("%Y%m%d-%H%M%S")
    return Settings(
        model=model, out=out, quick=args.quick,
        concurrencies=_concurrencies(args.concurrency or base["concurrency"]),
        requests=requests, max_tokens=max_tokens, scoring_prompts=scoring,
        mlx_lm=not args.no_mlx_lm, scoring=scoring > 0, constrained=args.constrained,
        prefix_cache=args.prefix_cache, step_tokens=args.step_tokens,
        workload=args.workload, speculative=args.speculative,
        peer=peers[0][0] if peers else None, peer_cmd=peers[0][1] if peers else None,
        rounds=args.rounds, peers=tuple(peers), agent_log=args.agent_log,
        agent_turns=args.agent_turns, agent_conversations=args.agent_conversations,
        page_poll=args.page_poll,
    )  # fmt: skip


def _peers(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(kind, command) of each --peer with the --peer-cmd at the same position."""
    names, cmds = args.peer or [], args.peer_cmd or []
    if len(names) != len(cmds):
        raise SystemExit("llm-benchmark: --peer and --peer-cmd go together")
    from llm_server.benchmark.servers import peer_command

    for cmd in cmds:
        try:
            peer_command(cmd, 0, 1)
        except ValueError as exc:
            raise SystemExit(f"llm-benchmark: {exc}") from None
    return [(PEERS[n], c) for n, c in zip(names, cmds, strict=True)]


def check_dependencies() -> None:
    """Fail at once, not after a long run, when a package the report needs is missing."""
    import importlib.util

    missing = [m for m in ("httpx", "matplotlib", "tqdm") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(
            f"llm-benchmark needs {', '.join(missing)}: run `pip install -e '.[dev]'` (or `make install`)"
        )


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C, so every server gets stopped


def main(argv: list[str] | None = None) -> None:
    from llm_server.native.blas import ensure_fast_blas

    ensure_fast_blas()  # same fast path as llm-server; --constrained runs the engine in-process
    args = build_parser().parse_args(argv)
    check_dependencies()
    settings = settings_from(args)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    if args.embeddings:
        _embeddings_only(settings, args.embedding_inputs)
        return
    if args.batch:
        _batch_only(settings, args.batch)
        return
    if settings.workload == "vision":
        _vision_only(settings)
        return
    from llm_server.benchmark.runner import run_benchmark

    if settings.workload == "agent":
        from llm_server.benchmark.agent import run_agent as run_benchmark  # noqa: F811
    try:
        paths = run_benchmark(settings)
    except KeyboardInterrupt:
        print("llm-benchmark: interrupted; all servers stopped", file=sys.stderr)
        sys.exit(130)
    with contextlib.suppress(OSError):
        print(paths.markdown.read_text())
    print(f"llm-benchmark: wrote {paths.json}, {paths.markdown} and {paths.plot}", file=sys.stderr)


def _batch_only(settings: Settings, lines: int) -> None:
    """--batch LINES: the Batch API beside interactive load (benchmark/batch_load.py)."""
    from llm_server.benchmark.batch_load import BatchLoad, measure

    load = BatchLoad(
        model=settings.model,
        lines=lines,
        concurrency=tuple(settings.concurrencies),
        max_tokens=settings.max_tokens,
        logs=settings.out,
    )
    try:
        print(measure(load))
    except KeyboardInterrupt:
        print("llm-benchmark: interrupted; all servers stopped", file=sys.stderr)
        sys.exit(130)
    print(f"llm-benchmark: wrote {settings.out / 'batch_load.json'}", file=sys.stderr)


def _vision_only(settings: Settings) -> None:
    """--workload vision: ours against mlx_vlm.server on a vision-language checkpoint."""
    from llm_server.benchmark.vision import model_is_vision, run_vision

    if not model_is_vision(settings.model):
        raise SystemExit(
            f"llm-benchmark: --workload vision needs a vision-language checkpoint; "
            f"{settings.model}/config.json has no vision_config"
        )
    try:
        print(run_vision(settings))
    except KeyboardInterrupt:
        print("llm-benchmark: interrupted; all servers stopped", file=sys.stderr)
        sys.exit(130)
    print(f"llm-benchmark: wrote {settings.out / 'vision.json'}", file=sys.stderr)


def _embeddings_only(settings: Settings, count: int) -> None:
    """--embeddings: our server alone, at the largest --concurrency value."""
    from llm_server.benchmark.embeddings import benchmark_embeddings

    if count < 1:
        raise SystemExit("llm-benchmark: --embedding-inputs must be 1 or more")
    concurrency = max(settings.concurrencies)
    try:
        result = benchmark_embeddings(
            settings.model, settings.out, count, concurrency, repeats=1 if settings.quick else 2
        )
    except KeyboardInterrupt:
        print("llm-benchmark: interrupted; all servers stopped", file=sys.stderr)
        sys.exit(130)
    print(result.markdown())
    print(f"llm-benchmark: wrote {settings.out / 'embeddings.json'}", file=sys.stderr)
