"""Expert reads into huge pages against 4 KiB pages: why the streaming store's slot arena lies on
2 MiB boundaries and no loan's end may split a huge page under it (engine/movement/slots.py).

    .venv/bin/python benchmarks/io/slot_pages.py --model DIR [--span 393216] [--reads 2000] [--json] [--lock FILE]

An O_DIRECT read pins its destination's pages and hands the device one segment per physically
contiguous run: an expert landing in one 2 MiB page is a segment or two, in 4 KiB pages about one per
page. Here each read is one preadv of --span bytes (default 384 KiB, an expert of the MTP reference)
at a random 4 KiB-aligned offset of the model's largest .safetensors file, alternately into
  huge   a slot of a SlotArena's kept mapping (2 MiB aligned, THP asked for its whole pages, faulted
         in up front: what every read of the store lands in), and
  split  a slot on a huge page that a MADV_DONTNEED of a neighbouring slot's bytes split (what the
         kept slots became before 3dcf618, each time a loan to the expert cache ended), and
  4k     the same bytes of a mapping advised MADV_NOHUGEPAGE,
the kinds taking the same offsets in turn, after the file's pages were dropped (O_DIRECT
reads bypass the page cache anyway). `huge bytes` is what the kernel really backed each buffer with
(AnonHugePages: where THP is off or no huge page was free, the huge row is 4 KiB pages too and says so).
Columns: read ms median, p90, mean; x huge = the median of the per-offset ratios to huge.
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

TOOL = "slot_pages"
_MADV_NOHUGEPAGE = getattr(mmap, "MADV_NOHUGEPAGE", 15)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _four_k_buffer(nbytes: int) -> mmap.mmap:
    """nbytes of private anonymous memory on 4 KiB pages, faulted in."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(_MADV_NOHUGEPAGE)
    except OSError:
        pass
    try:
        m.madvise(_MADV_POPULATE_WRITE, 0, nbytes)
    except OSError:  # kernels before 5.14
        m.write(bytes(nbytes))
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a model directory (its largest .safetensors file is read)")
    ap.add_argument("--span", type=int, default=393216, help="bytes per read (default 393216, a 384 KiB expert)")
    ap.add_argument("--reads", type=int, default=2000, help="reads per kind (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    from benchmarks.benchkit import add_output_flags, bench_lock, emit, refuse, run_conditions, spread
    from benchmarks.io.page_cache import drop_pages
    add_output_flags(ap)
    a = ap.parse_args(argv)
    files = sorted(Path(a.model).glob("*.safetensors"), key=lambda p: p.stat().st_size) if Path(a.model).is_dir() else []
    if not files:
        return refuse(TOOL, f"--model {a.model}: no .safetensors file there")
    path = files[-1]
    size = path.stat().st_size
    if a.span < 4096 or a.span % 4096 or a.span > size or a.reads < 1:
        return refuse(TOOL, f"--span {a.span}: a multiple of 4096 no larger than {path.name} ({size} bytes); "
                            f"--reads positive")
    from engine.api.lab import SlotArena, mapping_huge_bytes
    import ctypes
    arenas = [SlotArena(a.span, max(1, (4 << 20) // a.span + 2)) for _ in range(2)]  # huge pages' worth
    leases = [[arena.acquire() for _ in range(arena.count)] for arena in arenas]

    def inside_one_page(x) -> bool:
        return ctypes.addressof(x) // (2 << 20) == (ctypes.addressof(x) + a.span - 1) // (2 << 20)

    # a slot inside one huge page of the kept mapping where one fits, else the first; in the second arena,
    # its neighbour's first 4 KiB dropped (the page split), the slot itself untouched
    huge_slot = next((x for x in leases[0] if inside_one_page(x)), leases[0][0])
    split_slot = next((x for x in leases[1] if inside_one_page(x)), leases[1][0])
    page = ctypes.addressof(split_slot) // (2 << 20) * (2 << 20)
    neighbour = page if ctypes.addressof(split_slot) - page >= 4096 else ctypes.addressof(split_slot) + a.span
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise(ctypes.c_void_p(neighbour), ctypes.c_size_t(4096), 4)  # MADV_DONTNEED
    small = _four_k_buffer(a.span)
    targets = {"huge": memoryview(huge_slot).cast("B"), "split": memoryview(split_slot).cast("B"),
               "4k": memoryview(small)}
    backing = {"huge": mapping_huge_bytes(ctypes.addressof(huge_slot)),
               "split": mapping_huge_bytes(ctypes.addressof(split_slot)),
               "4k": mapping_huge_bytes(ctypes.addressof(ctypes.c_char.from_buffer(small)))}
    rng = random.Random(a.seed)
    offsets = [rng.randrange(0, (size - a.span) // 4096 + 1) * 4096 for _ in range(a.reads)]
    times = {k: [] for k in targets}
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        with bench_lock(a.lock):
            drop_pages([path])
            for i, offset in enumerate(offsets):
                kinds = list(targets)
                for kind in kinds[i % 3:] + kinds[:i % 3]:
                    t0 = time.perf_counter()
                    got = os.preadv(fd, [targets[kind]], offset)
                    times[kind].append(time.perf_counter() - t0)
                    if got != a.span:
                        return refuse(TOOL, f"{path}: short read at {offset} ({got} of {a.span} bytes)")
    finally:
        os.close(fd)
    rows = []
    for kind, ts in times.items():
        ms = sorted(t * 1000 for t in ts)
        rows.append({"buffer": kind, "huge_bytes": backing[kind], "read_ms": spread(ms),
                     "p90_ms": round(ms[int(0.9 * (len(ms) - 1))], 3), "mean_ms": round(statistics.mean(ms), 3),
                     "x_huge": round(statistics.median(t / h for t, h in zip(ts, times["huge"])), 3)})
    cols = [("buffer", lambda r: r["buffer"]), ("huge bytes", lambda r: r["huge_bytes"]),
            ("read ms median (min-max)", lambda r: f"{r['read_ms']['median']:.3f} ({r['read_ms']['min']:.3f}-"
                                                   f"{r['read_ms']['max']:.3f})"),
            ("p90 ms", lambda r: r["p90_ms"]), ("mean ms", lambda r: r["mean_ms"]), ("x huge", lambda r: r["x_huge"])]
    emit(TOOL, rows, run_conditions(a, file=path.name), a.json, cols)
    del targets, leases, huge_slot, split_slot
    return 0


if __name__ == "__main__":
    sys.exit(main())
