"""Turns 2-5 of a conversation on each API: TTFT against prefilling only the new tokens alone.

    python -m llm_server.native.blas python -m llm_server.benchmark.turns [--model PATH]
        [--system-tokens 3400] [--turns 5] [--max-tokens 16] [--out DIR]

One server (ours, a subprocess with the servers' env) runs a conversation on each API in turn:
chat (history resent), Responses with `previous_response_id`, Responses stateless (`store:
false`, the output items resent) and Messages (history resent, `cache_control` marks). All
four open with the same long system prompt (an agent's rules, ~`--system-tokens`) and their
own user text, so only the first conversation's first turn is cold. Every turn streams; TTFT is
the time to its first answer delta. After each turn from the second on, a prompt of as many
random token ids as the turn did not take from the cache (`prompt - cached`) runs alone through
/v1/completions (streamed, one token; random ids share no prefix with anything cached): the
time to prefill only the new tokens. Every request waits `--settle` seconds first (an agent's
tool or a user's reading: the engine stores the last turn's KV in the prefix cache when its row
is released, which a request sent at once would wait for). Reported per API and turn: prompt
and cached tokens, cached / previous prompt (target >= 0.95), TTFT / alone, and that ratio over
the turn's arithmetic floor (turn_cost.arithmetic_floor: the new tokens' attention over the
cached positions is work the alone prompt does not have; target <= 1.3).

The server runs `--rows` rows (default 4, the server's default): the alone prompts take other
rows and each turn reuses its conversation's row in place. With `--rows 1` every alone prompt
evicts the conversation from the row (its KV saved to the prefix cache) and each turn copies
its prefix back: the one-row server's path.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from llm_server.benchmark.servers import ServerSpec, running
from llm_server.benchmark.turn_cost import arithmetic_floor, countable

APIS = ("chat", "responses", "responses-stateless", "messages")
RULE = "Rule {i}: read the file before you edit it, keep each change small, and run the tests."
QUESTIONS = ["List the files in src.", "Open the failing test.", "What does it check?",
             "Fix the off-by-one.", "Run the tests again.", "Summarize the change."]  # fmt: skip


def _system(tokens: int) -> str:
    """About `tokens` tokens of agent instructions (SmolLM2's BPE: ~20 tokens a rule)."""
    return "You are a coding agent in a terminal.\n" + "\n".join(
        RULE.format(i=i) for i in range(tokens // 20)
    )


def _stream(client: httpx.Client, path: str, body: dict, first) -> tuple[float, list[dict]]:
    """POST a streaming request; (seconds to the first event `first` accepts, all events)."""
    t0, ttft, events = time.perf_counter(), None, []
    with client.stream("POST", path, json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{path}: {resp.status_code} {resp.read()[:400]!r}")
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and first(event):
                ttft = time.perf_counter() - t0
            events.append(event)
    return (ttft if ttft is not None else time.perf_counter() - t0), events


def _chat_delta(e: dict) -> bool:
    return any(
        (c.get("delta") or {}).get(k) for c in e.get("choices") or []
        for k in ("content", "reasoning_content", "tool_calls")
    )  # fmt: skip


class Conversation:
    """One API's conversation: `turn()` sends the next request and returns (ttft, prompt
    tokens, cached tokens, answer text)."""

    def __init__(self, client: httpx.Client, api: str, system: str, max_tokens: int) -> None:
        self.c, self.api, self.system, self.max_tokens = client, api, system, max_tokens
        self.n = 0
        self.history: list[dict] = []
        self.prev_id: str | None = None

    def _question(self) -> str:
        return f"[{self.api}] {QUESTIONS[self.n % len(QUESTIONS)]}"

    def turn(self) -> tuple[float, int, int, str]:
        out = getattr(self, "_" + self.api.replace("-", "_"))(self._question())
        self.n += 1
        return out

    def _chat(self, question: str) -> tuple[float, int, int, str]:
        self.history.append({"role": "user", "content": question})
        body = {"messages": [{"role": "system", "content": self.system}, *self.history],
                "max_tokens": self.max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        ttft, events = _stream(self.c, "/v1/chat/completions", body, _chat_delta)
        text = "".join(
            (c.get("delta") or {}).get("content") or "" for e in events for c in e.get("choices") or []
        )  # fmt: skip
        usage = next(e["usage"] for e in reversed(events) if e.get("usage"))
        self.history.append({"role": "assistant", "content": text})
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return ttft, usage["prompt_tokens"], cached, text

    def _responses(self, question: str, stateless: bool = False) -> tuple[float, int, int, str]:
        self.history.append({"role": "user", "content": question})
        body = {"instructions": self.system, "max_output_tokens": self.max_tokens,
                "temperature": 0, "stream": True}  # fmt: skip
        if stateless:
            body |= {"input": self.history, "store": False}
        else:
            body["input"] = self.history[-1:]
            if self.prev_id:
                body["previous_response_id"] = self.prev_id
        ttft, events = _stream(
            self.c, "/v1/responses", body, lambda e: e.get("type", "").endswith(".delta")
        )
        response = events[-1]["response"]
        self.prev_id = response["id"]
        if stateless:
            self.history += response["output"]
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        usage = response["usage"]
        cached = usage["input_tokens_details"]["cached_tokens"]
        return ttft, usage["input_tokens"], cached, text

    def _responses_stateless(self, question: str) -> tuple[float, int, int, str]:
        return self._responses(question, stateless=True)

    def _messages(self, question: str) -> tuple[float, int, int, str]:
        mark = {"type": "ephemeral"}
        for m in self.history:  # the mark stays on the last user turn only, as clients do
            for block in m["content"]:
                block.pop("cache_control", None)
        user = [{"type": "text", "text": question, "cache_control": mark}]
        self.history.append({"role": "user", "content": user})
        body = {"model": "default", "max_tokens": self.max_tokens, "temperature": 0,
                "stream": True, "messages": self.history,
                "system": [{"type": "text", "text": self.system, "cache_control": mark}]}  # fmt: skip
        ttft, events = _stream(
            self.c, "/v1/messages", body, lambda e: e["type"] == "content_block_delta"
        )
        text = "".join(
            e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta"
        )
        self.history.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
        usage = next(e["usage"] for e in reversed(events) if e["type"] == "message_delta")
        cached = usage["cache_read_input_tokens"]
        prompt = cached + usage["input_tokens"] + usage["cache_creation_input_tokens"]
        return ttft, prompt, cached, text


def alone(client: httpx.Client, tokens: int, rng: random.Random) -> float:
    """TTFT of `tokens` random ids as a fresh prompt (nothing cached shares them)."""
    vocab = client.get("/tokenizer_info").json()["vocab_size"]
    body = {"prompt": [rng.randrange(vocab // 8, vocab) for _ in range(tokens)], "max_tokens": 1,
            "temperature": 0, "stream": True}  # fmt: skip
    ttft, _ = _stream(client, "/v1/completions", body, lambda e: bool(e.get("choices")))
    return ttft


def run(model: Path, out: Path, system_tokens: int, turns: int, max_tokens: int,
        repeats: int, settle: float, rows: int = 4) -> dict:  # fmt: skip
    system = _system(system_tokens)
    rng = random.Random(0)
    config = countable(json.loads((model / "config.json").read_text()))
    spec = ServerSpec("ours", model, concurrency=rows, max_queued=4)
    rows = []
    with (
        running(spec, out / "logs" / "turns.log") as srv,
        httpx.Client(base_url=srv.url, timeout=900) as client,
    ):
        alone(client, 64, rng)  # the first forwards' warm-up
        for api in APIS:
            conv, previous = Conversation(client, api, system, max_tokens), None
            for t in range(turns):
                time.sleep(settle)
                ttft, prompt, cached, text = conv.turn()
                row = {"api": api, "turn": t + 1, "prompt": prompt, "cached": cached,
                       "new": prompt - cached, "ttft_s": round(ttft, 4), "answer": text}  # fmt: skip
                if previous is not None:
                    times = []
                    for _ in range(repeats):
                        time.sleep(settle)
                        times.append(alone(client, prompt - cached, rng))
                    row["alone_s"] = round(statistics.median(times), 4)
                    row["reuse"] = round(cached / previous, 4)
                    row["ratio"] = round(ttft / row["alone_s"], 3)
                    if config is not None:
                        row["floor"] = round(arithmetic_floor(config, cached, prompt - cached), 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
                previous = prompt
    report = {"model": str(model), "system_tokens": system_tokens, "turns": turns,
              "max_tokens": max_tokens, "settle_s": settle, "server_rows": spec.concurrency,
              "rows": rows}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "turns.json").write_text(json.dumps(report, indent=2))
    (out / "turns.md").write_text(markdown(report))
    return report


def markdown(report: dict) -> str:
    lines = [
        f"## Turns: TTFT against the new tokens alone ({report['turns']} turns, "
        f"{report['max_tokens']} answer tokens)",
        "",
        "| API | turn | prompt | cached | cached/prev prompt | TTFT s | new tokens alone s "
        "| ratio | floor | ratio/floor |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        if "ratio" not in r:
            lines.append(f"| {r['api']} | {r['turn']} | {r['prompt']} | {r['cached']} | | "
                         f"{r['ttft_s']:.3f} | | | | |")  # fmt: skip
            continue
        floor = f"{r['floor']:.2f} | {r['ratio'] / r['floor']:.2f}" if "floor" in r else "- | -"
        lines.append(
            f"| {r['api']} | {r['turn']} | {r['prompt']} | {r['cached']} | {r['reuse']:.3f} | "
            f"{r['ttft_s']:.3f} | {r['alone_s']:.3f} ({r['new']} tok) | {r['ratio']:.2f} | "
            f"{floor} |"
        )
    later = [r for r in report["rows"] if "ratio" in r]
    if later:
        over = [r["ratio"] / r["floor"] for r in later if "floor" in r]
        floors = (f"over the floor median {statistics.median(over):.2f}, max {max(over):.2f}"
                  if over else "no floor (the config is not llama-shaped)")  # fmt: skip
        lines += [
            "",
            f"Turns 2+ ({report['server_rows']} server rows): cached/prev prompt min "
            f"{min(r['reuse'] for r in later):.3f} (target >= 0.95); ratio median "
            f"{statistics.median(r['ratio'] for r in later):.2f}, max "
            f"{max(r['ratio'] for r in later):.2f}; {floors} (target <= 1.3)",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from llm_server.native.blas import ensure_fast_blas

    ensure_fast_blas()
    p = argparse.ArgumentParser(prog="python -m llm_server.benchmark.turns", description=__doc__)
    p.add_argument("--model", type=Path, help="model folder (default: the embedded SmolLM2)")
    p.add_argument("--out", type=Path, default=Path("benchmark-results/turns"))
    p.add_argument("--system-tokens", type=int, default=3400)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="alone prompts timed per turn (median)")
    p.add_argument("--settle", type=float, default=1.0, help="seconds before each request")
    p.add_argument("--rows", type=int, default=4, help="the server's --concurrent-requests")
    args = p.parse_args(argv)
    if args.model is None:
        from llm_server.default_model import default_model_path

        args.model = default_model_path()
    report = run(args.model, args.out, args.system_tokens, args.turns, args.max_tokens,
                 args.repeats, args.settle, args.rows)  # fmt: skip
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
