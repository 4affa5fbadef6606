"""Conformance suite for the read pools: every test of the contract runs over every backend
(reader threads, io_uring) and every I/O mode it reads, on real files; then backend choice."""

import concurrent.futures
import contextlib
import errno
import fcntl
import mmap
import os
import random
import sys
import termios
import threading
import warnings

import numpy as np
import pytest
import torch

from engine.base.config import EngineConfig
from engine.base.errors import ConfigError, ModelFormatError
from engine.movement.io import (
    ALIGN, IO_MODES, IOStats, ReadPool, UringPool, open_read_pool, uring_unavailable,
)
from colibri_requirements import needs

FILE_SIZE = 3 * (1 << 20) + 12345  # not a multiple of the page size: the EOF case matters
CHUNK_SIZES = (4096, 64 << 10, 1 << 20)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("io") / "weights.bin"
    data = np.random.default_rng(0).integers(0, 256, FILE_SIZE, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return str(path), data


def _ranges(seed=1, n=40):
    rng = random.Random(seed)
    fixed = [
        (0, 1),
        (0, ALIGN),
        (1, ALIGN),
        (ALIGN - 1, 2),
        (12345, 1 << 20),
        (FILE_SIZE - 1, 1),  # last byte
        (FILE_SIZE - 5000, 5000),  # range ending exactly at EOF, unaligned start
        (_align := FILE_SIZE - FILE_SIZE % ALIGN, FILE_SIZE - _align),  # aligned start, EOF end
        (0, FILE_SIZE),  # whole file
    ]
    rand = []
    for _ in range(n):
        offset = rng.randrange(FILE_SIZE)
        rand.append((offset, rng.randint(1, FILE_SIZE - offset)))
    return fixed + rand


# ---- the pools under test ---------------------------------------------------------------------

BACKENDS = ("threads", "uring")
UNAVAILABLE = uring_unavailable()


@contextlib.contextmanager
def _occupy_threads(pool):
    """Every reader thread busy until the block ends; yields the requests that costs (none)."""
    gate = threading.Event()
    for _ in range(pool.io_threads):
        pool._jobs.put((concurrent.futures.Future(), None, None, gate.wait, ()))
    try:
        yield 0
    finally:
        gate.set()


@contextlib.contextmanager
def _occupy_uring(pool, tmp_path):
    """Every place in the ring taken by a read of an empty FIFO until the block ends writes
    to it; yields the requests that costs (one per place)."""
    fifo = tmp_path / "occupy.fifo"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)  # so the pool's O_RDONLY open does not block
    try:
        held = [pool.submit(str(fifo), 0, 1) for _ in range(pool.io_threads)]
        yield pool.io_threads
        os.write(writer, b"x" * pool.io_threads)
        for f in held:
            assert bytes(f.result(timeout=30)) == b"x"
    finally:
        os.close(writer)


@pytest.fixture(params=BACKENDS)
def make_pool(request, tmp_path):
    """make_pool(io_mode, ...) builds this backend's pool; make_pool.occupy(pool) holds it busy."""
    backend = request.param
    if backend == "uring" and UNAVAILABLE:
        pytest.skip(needs("uring", f"io_uring unavailable here: {UNAVAILABLE}"))

    def make(io_mode, io_threads=4, chunk_size=4 << 20, stats=None):
        if backend == "uring" and io_mode == "mmap":
            pytest.skip("mmap mode is read by the reader threads under every io_backend")
        cls = ReadPool if backend == "threads" else UringPool
        return cls(io_mode, io_threads=io_threads, chunk_size=chunk_size, stats=stats)

    make.backend = backend
    make.occupy = _occupy_threads if backend == "threads" else (lambda pool: _occupy_uring(pool, tmp_path))
    return make


def _fdinfo_flags(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}") as fh:
        for line in fh:
            if line.startswith("flags:"):
                return int(line.split()[1], 8)
    raise AssertionError("no flags line in fdinfo")


@pytest.mark.parametrize("io_threads", [1, 4])
@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("io_mode", IO_MODES)
def test_reads_return_exact_file_bytes(data_file, io_mode, chunk_size, io_threads, make_pool):
    path, data = data_file
    stats = IOStats()
    with make_pool(io_mode, io_threads=io_threads, chunk_size=chunk_size, stats=stats) as pool:
        for offset, length in _ranges():
            buf = pool.read(path, offset, length)
            assert len(buf) == length
            assert bytes(buf) == data[offset : offset + length], (offset, length)
        assert pool.effective_mode == io_mode
    snap = stats.snapshot()
    assert snap["bytes_requested"] == sum(length for _, length in _ranges())
    assert snap["bytes_read"] >= snap["bytes_requested"]
    assert snap["requests"] >= len(_ranges())
    assert snap["read_seconds"] > 0


@pytest.mark.parametrize("io_mode", IO_MODES)
def test_span_is_one_request_unless_larger_than_chunk_size(data_file, io_mode, make_pool):
    path, data = data_file
    stats = IOStats()
    with make_pool(io_mode, io_threads=4, chunk_size=1 << 20, stats=stats) as pool:
        buf = pool.read(path, 0, 1 << 20)  # aligned window, so the piece count is exact
        assert bytes(buf) == data[: 1 << 20] and stats.requests == 1
        # Larger than chunk_size: split, but across the workers, never into more pieces.
        buf = pool.read(path, 0, 3 << 20)
        assert bytes(buf) == data[: 3 << 20] and stats.requests == 1 + 3
    stats.reset()
    with make_pool(io_mode, io_threads=4, chunk_size=64 << 10, stats=stats) as pool:
        buf = pool.read(path, 0, 1 << 20)
    assert bytes(buf) == data[: 1 << 20]
    assert stats.requests == 4  # 16 chunks' worth, but io_threads pieces
    assert stats.bytes_read == 1 << 20


@pytest.mark.parametrize("io_mode", ("direct", "buffered"))
def test_reads_land_in_the_given_buffer(data_file, io_mode, make_pool):
    path, data = data_file
    slot = mmap.mmap(-1, 3 * ALIGN)
    with make_pool(io_mode, io_threads=2) as pool:
        assert pool.buffer_bytes(100, 5000) == (2 * ALIGN if io_mode == "direct" else 5000)
        view = pool.read(path, 100, 5000, into=slot)
        assert bytes(view) == data[100:5100]
        # The view is a slice of the slot, not a copy: the slot holds the bytes too.
        start = 100 if io_mode == "direct" else 0
        assert slot[start:start + 5000] == data[100:5100]
        with pytest.raises(ValueError, match="smaller"):
            pool.read(path, 0, 4 * ALIGN, into=slot)


def test_cancelled_before_pickup_is_never_read(data_file, make_pool):
    path, _ = data_file
    stats = IOStats()
    with make_pool("buffered", io_threads=1, stats=stats) as pool:
        with make_pool.occupy(pool) as occupying:
            fut = pool.submit(path, 0, 4096)
            assert fut.cancel()
        assert pool.read(path, 0, 10) == open(path, "rb").read(10)
    assert fut.cancelled()
    assert stats.requests == occupying + 1  # only the second read reached the disk


def test_cancelled_read_releases_its_slot(data_file, make_pool):
    """A cancelled read's buffer (an arena slot) is not held by the pool once it is dropped."""
    from engine.movement.slots import SlotArena
    path, data = data_file
    arena = SlotArena(2 * ALIGN, 1)
    with make_pool("buffered", io_threads=1) as pool:
        with make_pool.occupy(pool):
            lease = arena.acquire()
            fut = pool.submit(path, 0, ALIGN, into=lease)
            assert fut.cancel()
            del lease
        view = pool.read(path, 5, 10)  # the pool has moved past the cancelled read
        assert bytes(view) == data[5:15]
        assert arena.stats()["slots_in_use"] == 0


def test_read_errors_keep_their_errno(tmp_path, make_pool):
    """A read the kernel fails (here EISDIR: a directory) raises that OSError, errno and all."""
    with make_pool("buffered") as pool:
        with pytest.raises(IsADirectoryError) as info:
            pool.read(str(tmp_path), 0, 10)
        assert info.value.errno == errno.EISDIR


def test_direct_rounds_chunk_size_to_pages(make_pool):
    with make_pool("direct", chunk_size=5000) as pool:
        assert pool.chunk_size == 2 * ALIGN
    with make_pool("buffered", chunk_size=5000) as pool:
        assert pool.chunk_size == 5000


@pytest.mark.parametrize("offset,length", [(1, 10), (4000, 200), (12345, 70000), (FILE_SIZE - 5000, 5000)])
def test_direct_reads_whole_aligned_windows(data_file, offset, length, make_pool):
    path, data = data_file
    stats = IOStats()
    with make_pool("direct", io_threads=2, chunk_size=8192, stats=stats) as pool:
        buf = pool.read(path, offset, length)
    assert bytes(buf) == data[offset : offset + length]
    window = -(-(offset + length) // ALIGN) * ALIGN - (offset // ALIGN) * ALIGN
    assert stats.bytes_read == window
    assert stats.bytes_read % ALIGN == 0
    assert stats.bytes_requested == length


def test_direct_really_opens_with_o_direct(data_file, make_pool):
    path, data = data_file
    with make_pool("direct") as pool:
        assert bytes(pool.read(path, 100, 5000)) == data[100:5100]
        assert pool.effective_mode == "direct"
        assert pool.open_flags(path) & os.O_DIRECT
        # Ask the kernel, not our bookkeeping.
        assert _fdinfo_flags(pool.fileno(path)) & os.O_DIRECT
    with make_pool("buffered") as pool:
        pool.read(path, 0, 10)
        assert not _fdinfo_flags(pool.fileno(path)) & os.O_DIRECT


def test_direct_falls_back_where_filesystem_refuses_o_direct(make_pool):
    # tmpfs accepts O_DIRECT since Linux 6.6, but procfs still refuses it with EINVAL at open,
    # and it holds real files with stable contents to compare against.
    path = "/proc/self/cmdline"
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        pytest.skip("this kernel accepts O_DIRECT on procfs; no refusing filesystem to test")
    except OSError as exc:
        assert exc.errno == errno.EINVAL
    with open(path, "rb") as fh:
        expected = fh.read()
    with make_pool("direct", io_threads=2) as pool:
        with pytest.warns(RuntimeWarning, match="O_DIRECT refused"):
            buf = pool.read(path, 0, len(expected))
        assert bytes(buf) == expected
        assert pool.effective_mode == "buffered"
        assert not pool.open_flags(path) & os.O_DIRECT
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # warned once, not per read
            assert bytes(pool.read(path, 1, 3)) == expected[1:4]


def test_tmpfs_o_direct_behaviour_is_handled(tmp_path, make_pool):
    """/dev/shm either reads with O_DIRECT or falls back; both must return the bytes."""
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    path = f"/dev/shm/colibri-io-test-{os.getpid()}"
    data = os.urandom(3 * ALIGN + 17)
    with open(path, "wb") as fh:
        fh.write(data)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            with make_pool("direct") as pool:
                assert bytes(pool.read(path, 5, len(data) - 5)) == data[5:]
                refused = False
                try:
                    os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
                except OSError:
                    refused = True
                assert pool.effective_mode == ("buffered" if refused else "direct")
    finally:
        os.unlink(path)


@pytest.mark.parametrize("io_mode", IO_MODES)
def test_concurrent_submits(data_file, io_mode, make_pool):
    path, data = data_file
    ranges = _ranges(seed=7, n=30)
    with make_pool(io_mode, io_threads=4, chunk_size=64 << 10) as pool:
        futures = [pool.submit(path, off, length) for off, length in ranges]
        # Submitting from several threads at once, as the prefetcher does.
        with concurrent.futures.ThreadPoolExecutor(4) as callers:
            more = list(callers.map(lambda r: pool.submit(path, *r), ranges))
        for (off, length), fut in zip(ranges + ranges, futures + more):
            assert bytes(fut.result(timeout=30)) == data[off : off + length]


@pytest.mark.parametrize("io_mode", IO_MODES)
def test_truncated_file_raises_model_format_error(tmp_path, io_mode, make_pool):
    path = tmp_path / "short.bin"
    path.write_bytes(os.urandom(10000))
    with make_pool(io_mode, chunk_size=4096) as pool:
        with pytest.raises(ModelFormatError, match="truncated file .* offset"):
            pool.read(str(path), 8000, 5000)
        with pytest.raises(ModelFormatError, match="truncated"):
            pool.read(str(path), 20000, 10)
        # The pool stays usable after a failed request.
        assert len(pool.read(str(path), 0, 10000)) == 10000


@pytest.mark.parametrize("io_mode", IO_MODES)
def test_buffers_work_with_torch_frombuffer(data_file, io_mode, make_pool):
    path, data = data_file
    with make_pool(io_mode) as pool:
        buf = pool.read(path, 4096 + 8, 4 * 1000)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # mmap views are read-only
            tensor = torch.frombuffer(buf, dtype=torch.float32)
    expected = np.frombuffer(data[4096 + 8 : 4096 + 8 + 4000], dtype=np.float32)
    assert tensor.shape == (1000,)
    assert np.array_equal(tensor.numpy(), expected, equal_nan=True)


@pytest.mark.parametrize("io_mode", ("direct", "buffered"))
def test_pread_buffers_are_writable_and_page_aligned_for_direct(data_file, io_mode, make_pool):
    path, _ = data_file
    with make_pool(io_mode) as pool:
        buf = pool.read(path, 0, 8192)
        assert not buf.readonly
        if io_mode == "direct":
            address = np.frombuffer(buf, dtype=np.uint8).ctypes.data
            assert address % mmap.PAGESIZE == 0


def test_zero_length_and_bad_arguments(data_file, make_pool):
    path, _ = data_file
    with make_pool("direct") as pool:
        assert len(pool.read(path, 10, 0)) == 0
        with pytest.raises(ValueError):
            pool.submit(path, -1, 10)
    with pytest.raises(ConfigError):
        make_pool("async")
    with pytest.raises(ConfigError):
        make_pool("direct", io_threads=0)
    with pytest.raises(ConfigError):
        make_pool("direct", chunk_size=0)


def test_missing_file_propagates(tmp_path, make_pool):
    with make_pool("buffered") as pool:
        with pytest.raises(FileNotFoundError):
            pool.read(str(tmp_path / "nope.bin"), 0, 10)


def test_drop_page_cache_and_reads_stay_correct(data_file, make_pool):
    path, data = data_file
    with make_pool("buffered") as pool:
        pool.read(path, 0, 100)
        pool.drop_page_cache(path)
        assert bytes(pool.read(path, 50, 100)) == data[50:150]


def test_close_releases_descriptors_and_refuses_new_work(data_file, make_pool):
    path, _ = data_file
    pool = make_pool("direct")
    pool.read(path, 0, 10)
    fd = pool.fileno(path)
    pool.close()
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(RuntimeError):
        pool.submit(path, 0, 10)
    pool.close()  # idempotent


def test_mmap_close_with_live_views(data_file, make_pool):
    path, data = data_file
    pool = make_pool("mmap")
    buf = pool.read(path, 10, 20)
    pool.close()
    assert bytes(buf) == data[10:30]  # the mapping outlives the pool while a view holds it


def test_stats_shared_and_reset(data_file, make_pool):
    path, _ = data_file
    stats = IOStats()
    with make_pool("buffered", stats=stats) as a, make_pool("direct", stats=stats) as b:
        a.read(path, 0, 100)
        b.read(path, 0, 100)
    assert stats.bytes_requested == 200
    assert stats.bytes_read == 100 + ALIGN
    assert stats.requests == 2
    stats.reset()
    assert stats.snapshot() == {"bytes_requested": 0, "bytes_read": 0, "requests": 0, "read_seconds": 0.0}


def test_close_waits_for_reads_in_flight(tmp_path, make_pool):
    """close() returns only after every submitted read has landed (none is lost or left
    writing into a buffer the caller may free)."""
    path = tmp_path / "data.bin"
    data = os.urandom(1 << 20)
    path.write_bytes(data)
    pool = make_pool("direct", io_threads=2, chunk_size=64 << 10)
    futures = [pool.submit(str(path), off, 200_000) for off in range(0, 800_000, 100_000)]
    pool.close()
    for off, fut in zip(range(0, 800_000, 100_000), futures):
        assert fut.done() and bytes(fut.result()) == data[off:off + 200_000]


# ---- io_uring specifics -------------------------------------------------------------------------

needs_uring = pytest.mark.skipif(bool(UNAVAILABLE), reason=needs("uring", f"io_uring unavailable here: {UNAVAILABLE}"))


def _fionread(fd: int) -> int:
    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0" * 4), sys.byteorder)


@needs_uring
def test_uring_short_read_is_issued_again_for_the_rest(tmp_path):
    """io_uring returns what a buffered read had (a FIFO: what was written); the pool reads on."""
    fifo = tmp_path / "short.fifo"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)
    stats = IOStats()
    try:
        with UringPool("buffered", io_threads=1, stats=stats) as pool:
            fut = pool.submit(str(fifo), 0, 10)
            os.write(writer, b"abcd")
            for _ in range(10_000_000):  # until the ring's read has taken those 4 bytes
                if _fionread(writer) == 0:
                    break
            assert not fut.done()
            os.write(writer, b"efghij")
            assert bytes(fut.result(timeout=30)) == b"abcdefghij"
    finally:
        os.close(writer)
    assert stats.requests == 1 and stats.bytes_read == 10


@needs_uring
def test_uring_keeps_io_threads_reads_in_flight(tmp_path):
    """io_threads is the ring's queue depth: with every place taken, the next read waits."""
    fifo = tmp_path / "qd.fifo"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR)
    try:
        with UringPool("buffered", io_threads=3) as pool:
            futures = [pool.submit(str(fifo), 0, 1) for _ in range(5)]
            assert pool._inflight == 3 and len(pool._queue) == 2
            os.write(writer, b"12345")
            assert sorted(bytes(f.result(timeout=30)) for f in futures) == [b"1", b"2", b"3", b"4", b"5"]
    finally:
        os.close(writer)


# ---- choosing the backend -----------------------------------------------------------------------


def test_io_backend_is_validated_and_round_trips(tmp_path):
    with pytest.raises(ConfigError, match="io_backend must be one of threads, uring, auto"):
        EngineConfig(io_backend="aio")
    path = tmp_path / "engine.toml"
    EngineConfig(io_backend="auto").save(path)
    assert EngineConfig.load(path).io_backend == "auto"
    with pytest.raises(ConfigError, match="io_backend"):
        open_read_pool("direct", "aio", 2, 1 << 20)


@pytest.mark.parametrize("backend", ["threads", "uring", "auto"])
def test_mmap_is_read_by_threads_under_every_backend(backend):
    with open_read_pool("mmap", backend, 2, 1 << 20) as pool:
        assert pool.backend == "threads"


@needs_uring
def test_open_read_pool_gives_each_backend():
    for backend, want in (("threads", "threads"), ("uring", "uring"), ("auto", "uring")):
        with open_read_pool("direct", backend, 2, 1 << 20) as pool:
            assert pool.backend == want


def test_without_the_binding_uring_fails_in_one_line_and_auto_falls_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "uring_api", None)  # what `import` sees where it is not installed
    with pytest.raises(ConfigError, match="needs the uring-api package") as info:
        open_read_pool("direct", "uring", 2, 1 << 20)
    assert "\n" not in str(info.value)
    with open_read_pool("direct", "auto", 2, 1 << 20) as pool:
        assert pool.backend == "threads"


def test_arena_spare_slots_lent_and_withheld():
    """Spare slots hold no memory until lent; withhold takes back lent slots only, never one of the kept
    mapping (their bytes, and the huge pages under them, stay), waits for a lent slot still held, drops
    the pages of those it takes (zeros once lent again), and the counts say so throughout."""
    import ctypes
    from engine.movement.slots import SlotArena
    arena = SlotArena(ALIGN, 2, spare=3)
    assert arena.count == 2 and arena.withheld == 3 and arena.stats()["arena_bytes"] == 2 * ALIGN
    assert arena.lend(5) == 3  # no more than it has
    assert arena.count == 5 and arena.free == 5 and arena.withheld == 0
    leases = [arena.acquire(owner=("expert", i)) for i in range(5)]
    assert all(lease is not None for lease in leases) and arena.acquire() is None
    indices = [arena.index_of(ctypes.addressof(lease)) for lease in leases]
    assert sorted(indices) == [0, 1, 2, 3, 4]
    assert arena.lent_owners() == [("expert", i) for i, x in enumerate(indices) if x >= 2]  # the lent ones'
    for lease in leases:
        ctypes.memset(ctypes.addressof(lease), 0xAB, ALIGN)
    del leases, lease
    assert arena.free == 5 and arena.lent_owners() == []
    assert arena.withhold(4) == 3  # the three lent: the two kept slots are not the loan's
    assert arena.count == 2 and arena.free == 2 and arena.withheld == 3 and arena.stats()["arena_bytes"] == 2 * ALIGN
    kept = [arena.acquire() for _ in range(2)]
    assert all(bytes(lease) == b"\xab" * ALIGN for lease in kept)  # never dropped
    assert arena.acquire() is None  # withheld slots are not handed out
    assert arena.lend(1) == 1
    held = arena.acquire(owner="x")
    assert held is not None and arena.lent_owners() == ["x"]
    assert arena.withhold(1, wait_s=0.01) == 0  # the lent slot is held: nothing to take
    del held
    assert arena.withhold(1) == 1 and arena.withhold(1) == 0  # nothing lent is left
    assert arena.lend(4) == 3
    again = [arena.acquire() for _ in range(3)]
    assert all(bytes(lease) == bytes(ALIGN) for lease in again)  # their pages were dropped: zero-filled
    assert arena.index_of(0) is None


def test_slot_arena_lays_out_kept_and_spare_slots_as_one_arena_of_them_all():
    """The kept slots and the spare ones after them lie back to back in one mapping that starts on a
    2 MiB boundary, so an arena whose spare slots start lent is laid out, and faulted in, as an arena of
    that many kept slots (the same huge pages); its lent slots are withheld like any lent ones."""
    import ctypes
    from engine.base.hugepages import HUGE_PAGE
    from engine.movement.slots import SlotArena
    slot = 3 * ALIGN * 25  # not a divisor of 2 MiB: slots straddle huge pages
    layouts = []
    for arena in (SlotArena(slot, 12, spare=7, lent=True), SlotArena(slot, 19)):
        assert arena.count == 19 and arena.stats()["arena_bytes"] == 19 * arena.slot_bytes
        leases = [arena.acquire() for _ in range(19)]  # (held: a released slot is handed out again)
        assert arena.acquire() is None
        at = {arena.index_of(ctypes.addressof(lease)): ctypes.addressof(lease) for lease in leases}
        assert sorted(at) == list(range(19)) and at[0] % HUGE_PAGE == 0
        assert all(at[i + 1] - at[i] == arena.slot_bytes for i in range(18))
        layouts.append([at[i] - at[0] for i in range(19)])
        del leases
    assert layouts[0] == layouts[1]
    lent = SlotArena(slot, 12, spare=7, lent=True)
    assert lent.withheld == 0 and lent.withhold(9) == 7  # the seven lent slots, no kept one
    assert lent.count == 12 and lent.withheld == 7 and lent.lend(7) == 7 and lent.count == 19
