"""Helpers shared by the tests and the benchmark (tiny deterministic checkpoints)."""
