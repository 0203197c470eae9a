"""JSON-object / JSON-schema constrained decoding with llguidance (`response_format`, issue 6).

`build_constraint` compiles a request's `response_format` into an llguidance matcher up front (a
schema it cannot compile raises ConstraintError, an HTTP 400, before any decoding) and returns a
per-request `LogitsConstraint` that masks one row's logits per step on the scheduler thread.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any

import numpy as np

from llm_server.decoding import LogitsConstraint

# Compact JSON with the separators json.dumps uses: no free whitespace, so a small model cannot
# wander into endless newlines/spaces, and the text tokenizes the way models usually saw JSON.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
SUPPORTED_TYPES = ("json_object", "json_schema")


class ConstraintError(ValueError):
    """The response_format cannot be compiled into a grammar (HTTP 400)."""


class ConstraintViolation(RuntimeError):
    """The matcher rejected a sampled token (a bug: masked tokens cannot be sampled)."""


# id(hf tokenizer) -> (weak reference to it, {(vocab_size, eos ids): LLTokenizer}); building one
# takes ~0.5 s, so it happens once per served tokenizer.
_tokenizers: dict[int, tuple[weakref.ref, dict[tuple[int, tuple[int, ...]], Any]]] = {}
_tokenizers_lock = threading.Lock()


def ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """The cached llguidance LLTokenizer for `tokenizer` (our Tokenizer or an HF fast one).

    `vocab_size` is the width of the model's logits (it may exceed the tokenizer's own size).
    """
    if hasattr(tokenizer, "hf"):  # our Tokenizer: EOS ids include the model config's
        hf, eos = tokenizer.hf, tuple(sorted(tokenizer.eos_token_ids))
    else:
        hf, eos = tokenizer, (int(tokenizer.eos_token_id),)
    key = (vocab_size, eos)
    with _tokenizers_lock:
        for dead in [k for k, (ref, _) in _tokenizers.items() if ref() is None]:
            del _tokenizers[dead]  # the tokenizer was collected; its id may be reused
        entry = _tokenizers.get(id(hf))
        if entry is None or entry[0]() is not hf:
            entry = (weakref.ref(hf), {})
            _tokenizers[id(hf)] = entry
        built = entry[1]
        if key not in built:
            import llguidance.hf

            try:
                built[key] = llguidance.hf.from_tokenizer(
                    hf, n_vocab=vocab_size, eos_token=list(eos)
                )
            except ValueError as exc:  # a slow (non-Rust) tokenizer
                raise ConstraintError(
                    f"constrained decoding is not available for this model's tokenizer: {exc}"
                ) from exc
        return built[key]


def schema_for(response_format: Any) -> dict[str, Any]:
    """The JSON schema a `response_format` asks for; ConstraintError when it is malformed."""
    if not isinstance(response_format, dict):
        raise ConstraintError("response_format must be an object with a 'type'")
    kind = response_format.get("type")
    if kind == "json_object":
        return ANY_OBJECT_SCHEMA
    if kind != "json_schema":
        raise ConstraintError(
            f"response_format.type {kind!r} is not supported; use one of {', '.join(SUPPORTED_TYPES)}"
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ConstraintError(
            "response_format.json_schema must be an object with 'name' and 'schema'"
        )
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise ConstraintError("response_format.json_schema.schema must be a JSON schema object")
    # `strict` needs no handling: the output is always held to the schema.
    return schema


def compile_grammar(schema: dict[str, Any], lltok: Any) -> Any:
    """A fresh llguidance matcher for `schema`; ConstraintError names what cannot compile."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise ConstraintError(f"response_format.json_schema.schema is not valid: {exc}") from exc
    matcher = LLMatcher(lltok, grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(
            f"response_format.json_schema.schema cannot be used: {matcher.get_error()}"
        )
    return matcher


class JsonConstraint(LogitsConstraint):
    """One request's grammar state: masks its row's logits and consumes its sampled tokens."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bitmask = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)  # [1, words]
        self.mask_seconds = 0.0  # time spent computing and applying masks (benchmark)
        self.steps = 0

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """logits [vocab] -> a new array with the tokens the grammar forbids set to -inf."""
        import llguidance.numpy

        t0 = time.perf_counter()
        if self.matcher.is_error():
            raise ConstraintViolation(f"constrained decoding failed: {self.matcher.get_error()}")
        llguidance.numpy.fill_next_token_bitmask(self.matcher, self.bitmask)
        width = logits.shape[-1]
        allowed = np.unpackbits(
            self.bitmask.view(np.uint8), bitorder="little", count=min(width, self.bitmask.size * 32)
        ).view(bool)
        out = np.full(width, -np.inf, dtype=np.float32)
        np.copyto(out[: allowed.size], logits[: allowed.size], where=allowed)
        self.mask_seconds += time.perf_counter() - t0
        self.steps += 1
        return out

    def advance(self, token: int) -> bool:
        """Consume `token`; True once the grammar is complete and accepts nothing more."""
        if not self.matcher.consume_token(int(token)):
            raise ConstraintViolation(f"constrained decoding failed: {self.matcher.get_error()}")
        return self.matcher.is_stopped()

    def accepting(self) -> bool:
        """True when the grammar accepts the text so far (an EOS may end it here)."""
        return bool(self.matcher.is_accepting())


def build_constraint(response_format: dict, tokenizer, vocab_size: int) -> LogitsConstraint:
    """A fresh per-request constraint for `response_format` (type json_object or json_schema).

    Raises ConstraintError (HTTP 400) for a malformed response_format or a schema llguidance
    cannot compile; nothing has been queued or decoded when it does.
    """
    schema = schema_for(response_format)
    matcher = compile_grammar(schema, ll_tokenizer(tokenizer, vocab_size))
    return JsonConstraint(matcher, vocab_size)


def build_lark_constraint(lark: str, tokenizer, vocab_size: int) -> LogitsConstraint:
    """A fresh per-request constraint for a lark grammar (tool calls, answers after thinking).

    Raises ConstraintError when llguidance cannot compile it (a schema it does not support).
    """
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_lark(lark)
    except (ValueError, TypeError) as exc:
        raise ConstraintError(f"the grammar cannot be compiled: {exc}") from exc
    matcher = LLMatcher(ll_tokenizer(tokenizer, vocab_size), grammar, log_level=0)
    if matcher.is_error():
        raise ConstraintError(f"the grammar cannot be used: {matcher.get_error()}")
    return JsonConstraint(matcher, vocab_size)
