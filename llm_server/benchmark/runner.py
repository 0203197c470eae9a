"""Run the whole benchmark: roofline, then each server at each concurrency, scoring, report."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

import httpx

from llm_server.benchmark import (
    engine_rate,
    load,
    memory,
    page_poll,
    report,
    roofline,
    scoring,
    servers,
    spec_report,
    summary,
    targets,
)
from llm_server.benchmark.plot import write_plot
from llm_server.benchmark.settings import Settings

GIB = 1 << 30
PAGE_KIND = "ours_page"  # our server with the page open (--page-poll)
SETTLE_S = 2.0  # idle time after a load before reading "RSS after the load"
MLX_LM_NOTE = (
    "mlx_lm.server {version} runs with its own batching defaults (--decode-concurrency 32, "
    "--prompt-concurrency 8, --prefill-step-size 2048, prompt cache on) and the same LD_PRELOAD; "
    "our server runs with --concurrent-requests N and --max-queued {queued}."
)
TOKEN_NOTE = (
    "from each stream's final usage chunk (stream_options.include_usage), i.e. the tokens the "
    "server generated, counted by the server; where a stream had no usage the content would be "
    "re-tokenized with the model's tokenizer (sources seen: {sources})."
)


@dataclass(frozen=True)
class OutputPaths:
    json: Path
    markdown: Path
    plot: Path


def load_prompts(workload: str = "chat") -> list[load.Prompt]:
    """The 32 fixed chat prompts shipped with the package, or the edit prompts (reproduce a
    passage with one change: speculative.EDIT_PASSAGES)."""
    if workload == "edit":
        from llm_server.benchmark.speculative import edit_messages

        return [load.Prompt(f"edit-{i}", m) for i, m in enumerate(edit_messages())]
    text = resources.files("llm_server.benchmark").joinpath("prompts.json").read_text()
    return [load.Prompt(p["id"], p["messages"]) for p in json.loads(text)["prompts"]]


def _tokenizer(model: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model / "tokenizer.json"))


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    with_mem = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        with_mem = f", {pages / GIB:.0f} GiB RAM"
    except (OSError, ValueError):
        pass
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores{with_mem}"


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True,
                             cwd=Path(__file__).parent, timeout=5)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _git_commit() -> str | None:
    """HEAD's short hash, with "+dirty" when the working tree has uncommitted changes."""
    head = _git("rev-parse", "--short", "HEAD")
    if head and _git("status", "--porcelain", "--untracked-files=no"):
        head += "+dirty"
    return head


def _meta(s: Settings, prompts: list[load.Prompt]) -> dict:
    def version(pkg: str) -> str | None:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return None

    return {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": _machine(),
        "load_average_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "model": str(s.model),
        "model_name": s.model.name,
        "quick": s.quick,
        "concurrencies": s.concurrencies,
        "rounds": s.rounds,
        "requests": s.requests,
        "max_tokens": s.max_tokens,
        "step_tokens": s.step_tokens,
        "workload": s.workload,
        "speculative": s.speculative,
        "prompt_count": len(prompts),
        "blas_preload": servers.server_env().get("LD_PRELOAD"),
        "versions": {p: version(p) for p in ("llm-server", "mlx", "mlx-lm", "numpy")},
        "git_commit": _git_commit(),
        "mlx_lm_note": MLX_LM_NOTE.format(version=version("mlx-lm"), queued=s.requests),
        "commands": {},
        "peer": None
        if s.peer is None
        else {"kind": s.peer, "label": servers.PEER_LABELS[s.peer], "command": s.peer_cmd},
    }


def _roofline(s: Settings, bw: roofline.Bandwidth, runs: dict) -> dict:
    wbytes = roofline.weight_bytes(s.model)
    roof_tps = bw.bytes_per_s / wbytes

    def c1_tps(name: str) -> float | None:
        return (runs.get(name, {}).get("1") or {}).get("tokens_per_s")

    ours, theirs = c1_tps("ours"), c1_tps("mlx_lm")
    return {
        "bandwidth_gb_s": bw.bytes_per_s / 1e9,
        "array_bytes": bw.array_bytes,
        "threads": bw.threads,
        "repeats": bw.repeats,
        "weight_bytes": wbytes,
        "roofline_tokens_per_s": roof_tps,
        "single_stream_tokens_per_s": ours,
        "single_stream_fraction": None if ours is None else ours / roof_tps,
        "mlx_lm_single_stream_fraction": None if theirs is None else theirs / roof_tps,
    }


def _scoring(s: Settings, url: str, encode, prompts: list[load.Prompt], c: int) -> dict:
    texts = [m["content"] for p in prompts for m in p.messages]
    items = scoring.scoring_prompts(texts, encode, s.scoring_prompts)
    try:
        res = scoring.run_scoring(url, items, repeats=1 if s.quick else 2)
    except (
        scoring.ScoringError,
        httpx.HTTPError,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
    ) as exc:
        # A missing or half-finished scoring route is reported, and the rest of the run goes on.
        return {
            "status": "unavailable",
            "error": f"{type(exc).__name__}: {exc}",
            "server_concurrency": c,
        }
    return {
        "status": "ok",
        "server_concurrency": c,
        "prompts": res.prompts,
        "lengths": res.lengths,
        "repeats": res.repeats,
        "padded_wall_s": res.padded.wall_s,
        "sequential_wall_s": res.sequential.wall_s,
        "padded_tokens_per_s": res.padded.tokens_per_s,
        "sequential_tokens_per_s": res.sequential.tokens_per_s,
        "speedup": res.speedup,
        "max_abs_logprob_diff": res.max_abs_logprob_diff,
    }


class _Progress:
    """tqdm over every request of every load; the description names the phase."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="req", file=sys.stderr, dynamic_ncols=True)

    def phase(self, text: str) -> None:
        self.bar.set_description_str(text)

    def step(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _one_server(
    s: Settings, kind: str, c: int, count, prompts, progress: _Progress, state: dict, rnd: int = 0
) -> None:
    """One run of `kind` at concurrency `c` (round `rnd`), appended to state["rounds"]."""
    extra: tuple[str, ...] = ()
    if kind in ("ours", PAGE_KIND) and s.step_tokens is not None:
        extra += ("--step-tokens", str(s.step_tokens))
    if kind in ("ours", PAGE_KIND) and s.speculative is not None:
        extra += ("--speculative", s.speculative)
    launched = "ours" if kind == PAGE_KIND else kind  # the same server, with the page open
    spec = servers.ServerSpec(
        launched, s.model, c, max_queued=max(s.requests, c), extra_args=extra, peer_cmd=s.peer_cmd
    )
    name = f"{kind}-c{c}" + (f"-r{rnd + 1}" if s.rounds > 1 else "")
    label = f"{kind} c={c}" + (f" round {rnd + 1}/{s.rounds}" if s.rounds > 1 else "")
    progress.phase(f"{label}: starting")
    with servers.running(spec, s.out / "logs" / f"{name}.log") as srv:
        state["meta"]["commands"][name] = {"argv": list(srv.command), "pid": srv.pid}
        progress.phase(f"{label}: warm-up")
        load.warm_up(srv.url, c, s.max_tokens, count)
        warm = memory.sample(srv.pid)
        progress.phase(f"{label}: load")
        spec_before = spec_report.snapshot(srv.url) if kind == "ours" else None
        with page_poll.polling(srv.url) if kind == PAGE_KIND else nullcontext() as polls:
            result = load.run_load(
                srv.url, prompts, c, s.requests, s.max_tokens, count, progress.step
            )
        time.sleep(SETTLE_S)
        after = memory.sample(srv.pid)
        run = summary.summarize_load(result, warm, after)
        if polls is not None:
            run.update(page_polls=polls.polls, page_polls_failed=polls.failed)
        if kind == "ours":  # draft ids verified/kept in this load, the cost model after it
            run.update(spec_report.delta(spec_before, spec_report.snapshot(srv.url)))
        state["rounds"].setdefault(kind, {}).setdefault(c, []).append(
            (run, summary.outputs_of(result))
        )
        if kind == "ours" and s.scoring and c == max(s.concurrencies) and rnd == 0:
            progress.phase(f"{label}: scoring")
            state["scoring"] = _scoring(s, srv.url, state["encode"], prompts, c)
    if kind == "ours":  # the engine alone, with the server stopped (same env, fresh process)
        progress.phase(f"engine c={c}: {c}-row decode steps")
        rate = engine_rate.measure(s.model, c, steps=8 if s.quick else 24, env=servers.server_env())
        run.update(engine_step_ms=rate["step_ms"], engine_tokens_per_s=rate["tokens_per_s"])
        run["served_over_engine"] = run["tokens_per_s"] / rate["tokens_per_s"]


def _constrained(s: Settings) -> dict:
    """Hand over to the constrained-decoding benchmark when it exists (owned elsewhere)."""
    try:
        from llm_server.benchmark import constrained
    except ImportError as exc:
        return {"status": "unavailable", "error": f"llm_server.benchmark.constrained: {exc}"}
    out = s.out / "constrained"
    argv = ["--model", str(s.model), "--out", str(out)] + (["--quick"] if s.quick else [])
    try:
        code = constrained.main(argv)
    except SystemExit as exc:
        code = exc.code
    return {"status": "ok" if code in (None, 0) else "failed", "exit_code": code, "argv": argv,
            "markdown": str(out / "constrained.md")}  # fmt: skip


def run_benchmark(s: Settings) -> OutputPaths:
    """Everything, in order; servers are always stopped, also on errors and interrupts."""
    s.out.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(s.workload)
    tok = _tokenizer(s.model)

    def encode(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    def count(text: str) -> int:
        return len(encode(text))

    kinds = ["ours", "mlx_lm"] if s.mlx_lm else ["ours"]
    if s.peer is not None:
        kinds.append(s.peer)
    if s.page_poll:
        kinds.append(PAGE_KIND)
    state: dict = {"meta": _meta(s, prompts), "servers": {}, "outputs": {}, "scoring": None,
                   "failures": [], "encode": encode, "rounds": {}}  # fmt: skip
    print("llm-benchmark: measuring read bandwidth", file=sys.stderr)
    bw_size, bw_repeats = (GIB // 4, 3) if s.quick else (GIB, 5)
    bw = roofline.measure_bandwidth(bw_size, bw_repeats)
    progress = _Progress(len(kinds) * len(s.concurrencies) * s.rounds * s.requests)
    try:
        for c in s.concurrencies:
            for rnd in range(s.rounds):
                # interleaved, so a drift in machine load hits every server alike; the order
                # turns round each round, so no server always runs first on a cooling machine
                for kind in kinds if rnd % 2 == 0 else kinds[::-1]:
                    try:
                        _one_server(s, kind, c, count, prompts, progress, state, rnd)
                    except (servers.ServerStartError, RuntimeError, OSError) as exc:
                        state["failures"].append(
                            {"server": kind, "concurrency": c, "round": rnd + 1, "error": str(exc)}
                        )
                        progress.bar.write(
                            f"llm-benchmark: {kind} at concurrency {c} failed: {exc}"
                        )
            for kind, by_c in state["rounds"].items():
                if c in by_c:
                    run, outputs = summary.median_run(by_c[c])
                    state["servers"].setdefault(kind, {})[str(c)] = run
                    state["outputs"].setdefault(kind, {})[c] = outputs
    finally:
        progress.close()
    # Measured again at the end and the better kept: a busy machine only ever lowers it.
    bw = max(bw, roofline.measure_bandwidth(bw_size, bw_repeats), key=lambda b: b.bytes_per_s)
    return _write(s, state, bw, kinds)


def _write(s: Settings, state: dict, bw: roofline.Bandwidth, kinds: list[str]) -> OutputPaths:
    outputs = state["outputs"]
    meta = state["meta"]
    meta["load_average_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    sources = sorted(
        {
            src
            for runs in state["servers"].values()
            for r in runs.values()
            for src in r["token_sources"]
        }
    )
    meta["token_counting"] = TOKEN_NOTE.format(sources=", ".join(sources) or "none")
    if not s.mlx_lm:
        meta["mlx_lm_note"] = "mlx_lm.server was not run (--no-mlx-lm)."
    rep = {
        "meta": meta,
        "servers": state["servers"],
        "identity": {k: summary.identity(outputs.get(k, {})) for k in kinds},
        "scoring": state["scoring"] if s.scoring else {"status": "skipped"},
        "roofline": _roofline(s, bw, state["servers"]),
        "failures": state["failures"],
        "outputs": {k: {str(c): v for c, v in runs.items()} for k, runs in outputs.items()},
    }
    if "mlx_lm" in outputs and "ours" in outputs:
        rep["identity"]["ours_vs_mlx_lm_same_text"] = summary.cross_match(
            outputs["ours"], outputs["mlx_lm"]
        )
    if s.constrained:
        rep["constrained"] = _constrained(s)
    if s.prefix_cache:
        from llm_server.benchmark import prefix

        turns = 2 if s.quick else 4
        rep["prefix_cache"] = prefix.run(s.model, s.out / "prefix", chats=4, turns=turns)
    rep["targets"] = targets.evaluate(rep)
    paths = OutputPaths(s.out / "benchmark.json", s.out / "benchmark.md", s.out / "benchmark.png")
    report.write_json(rep, paths.json)
    report.write_markdown(rep, paths.markdown)
    write_plot(rep, paths.plot)
    return paths
