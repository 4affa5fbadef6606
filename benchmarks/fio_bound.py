"""Folded into benchmarks/io_bound.py (the tool: `io_bound.py fio`) and benchmarks/io_jobs.py (the jobs).

These two names stay only because benchmarks/streaming.py (another stream's file this session)
imports them from here; delete this module when it imports benchmarks.io_jobs.
"""

from benchmarks.io_jobs import fio_run, request_bytes

__all__ = ["fio_run", "request_bytes"]
