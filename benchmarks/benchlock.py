"""The shared benchmark lock; it lives in benchmarks/benchkit.py with the rest of what the tools share.

Kept as a name only because peers.py and streaming.py (other streams' files this session) import
it from here; once they import benchmarks.benchkit, this module goes.
"""

from benchmarks.benchkit import bench_lock

__all__ = ["bench_lock"]
