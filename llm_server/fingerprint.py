"""`system_fingerprint` from a descriptor of what produced the output (S9)."""

from __future__ import annotations

import hashlib


def descriptor(model: str, engine: str, dtype: str, batch: int) -> str:
    return f"model={model};engine={engine};dtype={dtype};batch={batch}"


def system_fingerprint(model: str, engine: str, dtype: str, batch: int) -> str:
    digest = hashlib.sha256(descriptor(model, engine, dtype, batch).encode()).hexdigest()
    return f"fp_{digest[:12]}"
