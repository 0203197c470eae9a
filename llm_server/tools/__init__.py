"""Tool calling and reasoning output: request specs, per-family parsers, grammars, assembly."""
