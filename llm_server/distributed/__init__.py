"""One model split over several processes (or Macs) with `mx.distributed`: every layer sharded
(tensor parallel, mlx-lm's `shard`) or the layers divided among the ranks (pipeline.py).

Rank 0 serves HTTP and runs the scheduler; every engine call that runs a forward or changes a
row (a step plan, a prefill, a decode, a release, a scoring chunk) is encoded as a small int
array (codec.py), broadcast through the group (transport.py) and executed by every rank in
lock-step (engine.py on rank 0, follower.py elsewhere); sampling happens on rank 0 only.
`launch.py` joins the group and picks the rank's role.
"""

from pathlib import Path

# how a request failed by a lost group begins its error (the API answers it with 503)
GROUP_LOST = "the distributed group was lost"


def group_lost(error: str | None) -> bool:
    """Whether a request's error says the group was lost (a rank died or hangs)."""
    return bool(error) and error.startswith(GROUP_LOST)


def checkpoint_bytes(path: Path) -> int:
    """Bytes of the checkpoint's weight files: a size every rank agrees on (the prefix cache's
    default bound on a split model, where each rank's own weights differ)."""
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
