"""JSON-object / JSON-schema constrained decoding with llguidance (issue 6).

STUB: being implemented. `build_constraint` is the contract with the API layer.
"""

from __future__ import annotations

from llm_server.decoding import LogitsConstraint


class ConstraintError(ValueError):
    """The response_format cannot be compiled into a grammar (HTTP 400)."""


def build_constraint(response_format: dict, tokenizer, vocab_size: int) -> LogitsConstraint:
    """A fresh per-request constraint for `response_format` (type json_object or json_schema)."""
    raise ConstraintError("response_format json modes are not available yet")
