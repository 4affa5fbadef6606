"""Folded into benchmarks/io_bound.py (the tool: `io_bound.py replay`) and benchmarks/io_jobs.py (the jobs).

These names stay only because benchmarks/streaming.py (another stream's file this session) uses
them as `trace_bound.measure_row` / `finish_row` / `print_rows`; delete this module when it
imports benchmarks.io_bound.
"""

from benchmarks.io_bound import finish_row, measure_row, print_rows

__all__ = ["finish_row", "measure_row", "print_rows"]
