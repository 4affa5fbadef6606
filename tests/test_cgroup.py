"""tuner.sandbox against the machine's real cgroups (skipped, with the detected reason, where
child memory cgroups cannot be made), plus detection on fake cgroup trees."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tuner.sandbox import cgroups as cgroup
from tuner.sandbox import current_memory_limit, detect_memory_cgroup, run_limited
from engine.base.errors import BudgetError

from colibri_sync import GUARD_S, wait_until
from colibri_requirements import needs

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20

# Allocates N MiB and touches every page, so it is really charged.
ALLOCATE = "import sys\nb = bytearray(int(sys.argv[1]) << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint('done')"
# Reads a file through the page cache, 1 MiB at a time: little anonymous memory.
READ_BUFFERED = "import sys\nn = 0\nwith open(sys.argv[1], 'rb') as f:\n    while c := f.read(1 << 20): n += len(c)\nprint(n)"


@pytest.fixture(scope="module")
def support():
    found = detect_memory_cgroup()
    if not found.available:
        pytest.skip(needs("cgroup", f"needs a child memory cgroup (root with cgroup v1 memory, or a delegated v2 subtree); "
                    f"here: {found.reason}"))
    return found


def _children(support) -> list[str]:
    prefix = f"colibri-{os.getpid()}-"
    return [p.name for p in Path(support.path).iterdir() if p.name.startswith(prefix)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # an unreaped zombie is dead for our purpose


def test_allocation_under_the_limit_succeeds_and_peak_is_measured(support):
    r = run_limited([sys.executable, "-c", ALLOCATE, "64"], 256 * MiB)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "done"
    assert r.limited and r.reason == "" and r.limit_bytes == 256 * MiB
    assert not r.oom_killed and not r.timed_out
    assert 64 * MiB < r.peak_bytes <= 256 * MiB
    assert _children(support) == []


def test_allocation_over_the_limit_is_oom_killed(support):
    r = run_limited([sys.executable, "-c", ALLOCATE, "300"], 128 * MiB)
    assert r.oom_killed
    assert r.returncode == -signal.SIGKILL
    assert not r.timed_out
    assert "done" not in r.stdout
    assert r.peak_bytes <= 128 * MiB
    assert _children(support) == []


def test_page_cache_is_charged_but_reclaimed_within_the_limit(support, tmp_path):
    big = tmp_path / "big.bin"
    size = 128 * MiB
    with open(big, "wb") as f:
        for _ in range(size // MiB):
            f.write(os.urandom(MiB))
        f.flush()
        os.fsync(f.fileno())

    def evict():  # pages already cached are charged to whoever read them first, not the child
        fd = os.open(big, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)

    evict()
    roomy = run_limited([sys.executable, "-c", READ_BUFFERED, str(big)], 1024 * MiB)
    assert roomy.returncode == 0 and int(roomy.stdout) == size
    # Far more than the reader's own memory: the cache it filled is in the cgroup's account.
    assert roomy.peak_bytes > size

    evict()
    tight = run_limited([sys.executable, "-c", READ_BUFFERED, str(big)], 48 * MiB)
    assert tight.returncode == 0 and int(tight.stdout) == size
    assert not tight.oom_killed  # clean cache is reclaimed, not fatal
    assert tight.peak_bytes <= 48 * MiB
    assert _children(support) == []


def test_timeout_kills_the_whole_process_group(support):
    # The test means something only once the grandchild exists (its pid printed) before the
    # timeout fires. sh starts in milliseconds; a box too loaded to start it within the timeout
    # gets a longer one, so the outcome never depends on how busy the machine is.
    for timeout in (3.0, 15.0, 75.0):
        r = run_limited(["sh", "-c", "sleep 600 & echo $!; wait"], 256 * MiB, timeout=timeout)
        if r.stdout.strip():
            break
    assert r.timed_out and not r.oom_killed
    assert r.returncode == -signal.SIGKILL
    assert r.stdout.strip().isdigit(), f"the command printed no grandchild pid: {r.stdout!r} {r.stderr!r}"
    assert not _alive(int(r.stdout))
    assert _children(support) == []


def test_leftover_daemon_is_killed_and_the_cgroup_removed(support):
    # The grandchild leaves the process group, so only the cgroup still knows about it.
    escape = (
        "import subprocess\n"
        "p = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        "print(p.pid)"
    )
    r = run_limited([sys.executable, "-c", escape], 256 * MiB)
    assert r.returncode == 0
    assert not _alive(int(r.stdout))
    assert _children(support) == []


def test_limit_is_visible_to_the_child(support):
    probe = "from tuner.sandbox import current_memory_limit; print(current_memory_limit())"
    r = run_limited([sys.executable, "-c", probe], 200 * MiB, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == 200 * MiB


def test_missing_command_raises_and_cleans_up(support):
    with pytest.raises(FileNotFoundError):
        run_limited(["colibri-no-such-command-xyz"], 64 * MiB)
    assert _children(support) == []


def test_env_and_cwd_reach_the_command(support, tmp_path):
    code = "import os; print(os.environ['COLIBRI_PROBE'], os.getcwd())"
    env = dict(os.environ, COLIBRI_PROBE="hello")
    r = run_limited([sys.executable, "-c", code], 128 * MiB, env=env, cwd=tmp_path)
    assert r.limited
    assert r.stdout.split() == ["hello", str(tmp_path)]


def test_no_limit_runs_plainly():
    r = run_limited([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"], None)
    assert (r.returncode, r.stdout, r.stderr) == (3, "out\n", "err\n")
    assert not r.limited and r.peak_bytes is None and r.limit_bytes is None
    assert "no memory limit" in r.reason
    with pytest.raises(BudgetError):
        run_limited(["true"], None, require=True)


def test_timeout_without_a_cgroup():
    r = run_limited(["sleep", "60"], None, timeout=0.5)
    assert r.timed_out and r.returncode == -signal.SIGKILL and not r.limited


def test_no_cgroup_mounted_falls_back_or_raises(monkeypatch, tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("22 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n")
    monkeypatch.setattr(cgroup, "_MOUNTINFO", str(mountinfo))
    found = detect_memory_cgroup()
    assert not found.available and "no cgroup filesystem" in found.reason
    r = run_limited(["echo", "hi"], 64 * MiB)
    assert r.stdout == "hi\n" and not r.limited and r.peak_bytes is None
    assert r.limit_bytes == 64 * MiB and "no cgroup filesystem" in r.reason
    with pytest.raises(BudgetError, match="no cgroup filesystem"):
        run_limited(["true"], 64 * MiB, require=True)
    assert current_memory_limit() is None


def test_detect_rejects_a_plain_directory(tmp_path):
    (tmp_path / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    found = detect_memory_cgroup(root=tmp_path)
    assert not found.available and found.version == 1
    # root makes the probe child and sees no control files; anyone else may not write at all
    assert "not a cgroup filesystem" in found.reason or "not writable" in found.reason
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory.limit_in_bytes"]


def test_detect_rejects_missing_or_controllerless_roots(tmp_path):
    found = detect_memory_cgroup(root=tmp_path / "nope")
    assert not found.available and "does not exist" in found.reason
    found = detect_memory_cgroup(root=tmp_path)
    assert not found.available and "no memory controller" in found.reason


def test_detect_v2_without_delegated_memory_controller(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("cpu\n")
    found = detect_memory_cgroup(root=tmp_path)
    assert not found.available and found.version == 2
    assert "subtree_control" in found.reason


def _unprivileged_python() -> str | None:
    for candidate in (sys.executable, "/usr/bin/python3"):
        try:
            subprocess.run([candidate, "-c", "pass"], user=65534, group=65534, check=True, capture_output=True)
            return candidate
        except (OSError, subprocess.CalledProcessError):
            continue
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to switch to an unprivileged user")
def test_unprivileged_user_gets_a_reason_not_a_crash(support):
    python = _unprivileged_python()
    if python is None:
        pytest.skip("no Python interpreter the nobody user may run")
    code = (
        "from tuner.sandbox import detect_memory_cgroup, run_limited\n"
        "s = detect_memory_cgroup(); r = run_limited(['echo', 'ran'], 64 << 20)\n"
        "print(s.available, r.limited, r.stdout.strip()); print(s.reason)"
    )
    # The checkout may sit where nobody cannot read it (CI clones into a 0700 mktemp dir), so
    # the unprivileged interpreter imports a world-readable copy of the sandbox and what it uses.
    readable = Path(tempfile.mkdtemp(prefix="colibri-nobody-"))
    try:
        for rel in ("engine/__init__.py", "engine/base/__init__.py", "engine/base/errors.py", "tuner/__init__.py",
                    # the front door the sandbox imports its errors through (its names resolve lazily)
                    "engine/api/__init__.py", "engine/api/lazy.py", "engine/api/results.py",
                    "tuner/base/__init__.py", "tuner/base/interrupts.py", *(
                str(p.relative_to(ROOT)) for p in (ROOT / "tuner" / "sandbox").glob("*.py"))):
            (readable / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / rel, readable / rel)
        for d, _dirs, files in os.walk(readable):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(os.path.join(d, f), 0o644)
        r = subprocess.run([python, "-c", code], user=65534, group=65534, cwd=readable, capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": str(readable)})
    finally:
        shutil.rmtree(readable, ignore_errors=True)
    assert r.returncode == 0, r.stderr
    first, reason = r.stdout.splitlines()
    assert first == "False False ran"
    assert "not writable" in reason and support.path in reason


def _fake_hierarchy(monkeypatch, tmp_path, fstype: str, options: str, own: str) -> Path:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    (tmp_path / "mountinfo").write_text(f"30 25 0:27 / {mnt} rw,nosuid - {fstype} {fstype} {options}\n")
    (tmp_path / "cgroup").write_text(own + "\n")
    monkeypatch.setattr(cgroup, "_MOUNTINFO", str(tmp_path / "mountinfo"))
    monkeypatch.setattr(cgroup, "_PROC_CGROUP", str(tmp_path / "cgroup"))
    return mnt


def test_current_memory_limit_is_the_smallest_of_own_cgroup_and_ancestors(monkeypatch, tmp_path):
    mnt = _fake_hierarchy(monkeypatch, tmp_path, "cgroup", "rw,memory", "5:memory:/a/b")
    (mnt / "a" / "b").mkdir(parents=True)
    (mnt / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # the root: unlimited
    (mnt / "a" / "memory.limit_in_bytes").write_text(f"{300 * MiB}\n")
    (mnt / "a" / "b" / "memory.limit_in_bytes").write_text(f"{500 * MiB}\n")
    assert current_memory_limit() == 300 * MiB
    (mnt / "a" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert current_memory_limit() == 500 * MiB


def test_current_memory_limit_v2_max_means_none(monkeypatch, tmp_path):
    mnt = _fake_hierarchy(monkeypatch, tmp_path, "cgroup2", "rw", "0::/job")
    (mnt / "job").mkdir()
    (mnt / "cgroup.controllers").write_text("cpu memory\n")
    (mnt / "job" / "cgroup.controllers").write_text("memory\n")
    (mnt / "job" / "memory.max").write_text("max\n")
    assert current_memory_limit() is None
    (mnt / "job" / "memory.max").write_text(f"{64 * MiB}\n")
    assert current_memory_limit() == 64 * MiB


def test_rejects_bad_arguments():
    with pytest.raises(ValueError):
        run_limited([], 64 * MiB)
    with pytest.raises(ValueError):
        run_limited(["true"], 0)


def test_keyboard_interrupt_kills_the_command_and_removes_the_cgroup(support, tmp_path):
    pid_file = tmp_path / "pid"
    # Written whole (temp file + rename): the file appearing is the event "the command runs".
    command = (f"import os, time; open({str(pid_file)!r} + '.tmp', 'w').write(str(os.getpid())); "
               f"os.rename({str(pid_file)!r} + '.tmp', {str(pid_file)!r}); time.sleep(600)")
    caller = (
        "import sys\n"
        "from tuner.sandbox import run_limited\n"
        f"run_limited([sys.executable, '-c', {command!r}], 128 << 20)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", caller], cwd=ROOT, stderr=subprocess.PIPE)
    try:
        wait_until(pid_file.exists, "the command running inside its cgroup", proc)
        command_pid = int(pid_file.read_text())
        leftovers = [p for p in Path(support.path).iterdir() if p.name.startswith(f"colibri-{proc.pid}-")]
        assert len(leftovers) == 1  # the run really is in a cgroup of its own
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert b"KeyboardInterrupt" in err
    assert not _alive(command_pid)
    assert not leftovers[0].exists()


# Answers each stdin line: "alloc N" touches N MiB more and says the total; anything else is echoed.
CONVERSE = ("import sys\nheld = []\nfor line in sys.stdin:\n    w = line.split()\n"
            "    if w and w[0] == 'alloc':\n        b = bytearray(int(w[1]) << 20)\n"
            "        for i in range(0, len(b), 4096): b[i] = 1\n        held.append(b)\n"
            "        print(sum(len(x) for x in held) >> 20, flush=True)\n"
            "    else:\n        print(line.strip()[::-1], flush=True)\n")


def test_a_limited_process_answers_line_by_line_within_its_limit(support):
    """LimitedProcess: a child kept alive in its own cgroup answers each line in turn; what it holds
    stays charged to its cgroup between questions; closing it ends it and removes the cgroup."""
    from tuner.sandbox import LimitedProcess
    with LimitedProcess([sys.executable, "-c", CONVERSE], 256 * MiB) as p:
        assert p.limited and p.reason == ""
        assert p.ask("abc") == "cba\n"
        assert p.ask("alloc 32").strip() == "32"
        assert p.ask("alloc 32").strip() == "64"
        assert 64 * MiB < p.peak() <= 256 * MiB
        pid = p.proc.pid
        assert _children(support) != []
    assert not _alive(pid) and _children(support) == []


def test_a_limited_process_over_its_limit_ends_with_an_error_not_an_answer(support):
    from tuner.sandbox import LimitedProcess
    p = LimitedProcess([sys.executable, "-c", CONVERSE], 96 * MiB)
    try:
        assert p.ask("alloc 16").strip() == "16"
        with pytest.raises(RuntimeError, match="before answering"):
            p.ask("alloc 200")
    finally:
        p.close()
    assert _children(support) == []
