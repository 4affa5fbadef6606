"""A verify's accept loop (engine/run/speculative.py accept_rows) in isolation: greedy, nothing
shaping the logits, every drafted token accepted, row by row (each row's finiteness check and argmax
alone, what plain decoding runs per token) against every row's argmax in one call and one finiteness
check for all rows (Steps.unshaped). Both paths are the engine's own, so one run compares them.

Why: on a small resident model a copy's verify of 9 rows costs ~2.3 ms and emits ~6 tokens; what the
loop spends per row is a share of every emitted token.

    python benchmarks/time/accept_loop.py [--rows 3,5,9] [--vocab 4096,151552] [--repeats 2000] [--threads 2]
        [--json] [--lock FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.benchkit import add_output_flags, bench_lock, emit, refuse, run_conditions  # noqa: E402

TOOL = "accept_loop"
ROUNDS = 5  # alternated rounds per (rows, vocab): the median is printed


def _time_accept(logits, drafts, unshaped: bool, repeats: int) -> float:
    """Microseconds per call of accept_rows on these rows, all drafts accepted."""
    from engine.api import Sampler, Steps, accept_rows, check_finite_logits
    out: list[int] = []
    steps = Steps(Sampler(), lambda raw: (check_finite_logits(raw), raw)[1], lambda token, raw: out.append(token),
                  lambda token: False, 1 << 30, None, unshaped=unshaped)

    class Gen:  # what _accept writes: the per-token times and the output
        token_seconds: list[float] = []
        output_ids = out

    t0 = time.perf_counter()
    for _ in range(repeats):
        out.clear()
        Gen.token_seconds = []
        emitted, accepted, _, _ = accept_rows(steps, Gen, logits, drafts, t0)
    seconds = time.perf_counter() - t0
    if accepted != len(drafts):
        raise RuntimeError("a draft was rejected: the rows' argmaxes are the drafts")
    return seconds / repeats * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="3,5,9", help="verify rows (drafts + 1), comma-separated (default 3,5,9)")
    ap.add_argument("--vocab", default="4096,151552", help="vocabulary sizes (default 4096,151552: the reference, GLM)")
    ap.add_argument("--repeats", type=int, default=2000, help="calls per timing (default 2000)")
    ap.add_argument("--threads", type=int, default=2)
    add_output_flags(ap)
    a = ap.parse_args(argv)
    try:
        rows = [int(x) for x in a.rows.split(",") if x]
        vocabs = [int(x) for x in a.vocab.split(",") if x]
    except ValueError:
        return refuse(TOOL, "--rows and --vocab take comma-separated integers")
    if not rows or min(rows) < 1 or not vocabs or min(vocabs) < 2 or a.repeats < 1:
        return refuse(TOOL, "--rows >= 1, --vocab >= 2, --repeats >= 1")
    import torch
    torch.set_num_threads(a.threads)
    table = []
    for n in rows:
        for vocab in vocabs:
            logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(n * 7 + vocab))
            drafts = logits.argmax(dim=-1).tolist()[:n - 1]
            repeats = max(1, a.repeats * 4096 // vocab)
            times: dict[bool, list[float]] = {False: [], True: []}
            for r in range(ROUNDS):
                for unshaped in ((False, True) if r % 2 == 0 else (True, False)):
                    with bench_lock(a.lock):
                        times[unshaped].append(_time_accept(logits, drafts, unshaped, repeats))
            by_row, at_once = statistics.median(times[False]), statistics.median(times[True])
            table.append({"rows": n, "vocab": vocab, "row_by_row_us": round(by_row, 1),
                          "at_once_us": round(at_once, 1), "saved_us_per_row": round((by_row - at_once) / n, 2),
                          "x": round(by_row / at_once, 2)})
    emit(TOOL, table, run_conditions(a), a.json, [
        ("rows", lambda r: r["rows"]), ("vocab", lambda r: r["vocab"]),
        ("row by row us", lambda r: r["row_by_row_us"]), ("at once us", lambda r: r["at_once_us"]),
        ("saved us / row", lambda r: r["saved_us_per_row"]), ("x", lambda r: r["x"])])
    return 0


if __name__ == "__main__":
    sys.exit(main())
