"""One model sharded over several processes (or Macs) with `mx.distributed`.

Rank 0 serves HTTP and runs the scheduler; every engine call that runs a forward or changes a
row (a step plan, a prefill, a decode, a release, a scoring chunk) is encoded as a small int
array (codec.py), broadcast through the group (transport.py) and executed by every rank in
lock-step (engine.py on rank 0, follower.py elsewhere); sampling happens on rank 0 only.
`launch.py` joins the group and picks the rank's role.
"""
