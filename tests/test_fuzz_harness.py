"""The fuzz harness itself (tests/colibri_fuzz.py + its fork server): every way a call can break
the property is caught and classified, so a green fuzz run means the commands behaved, not that
the harness looked away. Each misbehaviour below is a function the server runs in place of
`colibri.cli.main` (the request's "entry"), in the same forked grandchild under the same limits.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from colibri_fuzz import Call, Result, Victims, run_batch, summarize

MiB = 1 << 20
ME = "test_fuzz_harness"


def clean_refusal(argv):
    print("colibri run: error: model directory 'x' does not exist", file=sys.stderr)
    return 2


def success(argv):
    print('{"ok": true}')
    return 0


def two_error_lines(argv):
    print("colibri run: error: one\ncolibri run: error: two", file=sys.stderr)
    return 2


def unnamed_input(argv):
    print("colibri run: error: something is wrong", file=sys.stderr)
    return 2


def exit_one(argv):
    return 1


def raises(argv):
    raise KeyError("escaped main")


def printed_traceback(argv):
    print("Traceback (most recent call last):\n  File ...\nValueError: x", file=sys.stderr)
    return 2


def loops_forever(argv):
    while True:
        time.sleep(0.01)


def ignores_the_alarm(argv):
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])  # like a call stuck in native code
    while True:
        time.sleep(0.01)


def grows(argv):
    chunks = []
    while True:  # zero pages from calloc: address space (the limit's measure) grows at once, RSS little
        chunks.append(bytearray(64 * MiB))


def peaks(argv):
    block = bytearray(b"\1" * (256 * MiB))
    del block
    return 0


def killed(argv):
    os.kill(os.getpid(), signal.SIGKILL)


def exits_hard(argv):
    os._exit(0)  # never reports


def changes_its_process(argv):
    os.chdir("/")
    os.environ["COLIBRI_HARNESS_LEAK"] = "1"
    return 0


def sees_a_clean_process(argv):
    leaked = os.environ.get("COLIBRI_HARNESS_LEAK") or os.getcwd() == "/"
    return 1 if leaked else 0


def call(entry: str, names=("'x'",)) -> Call:
    return Call(["run", "--model", "x"], names=names, note=entry, kind="harness")


def run_entries(entries: list[str], **kw) -> list[Result]:
    """Each entry in its own request (the entry is per request, like argv)."""
    out = []
    for e in entries:
        out += run_batch([call(e)], entry=f"{ME}:{e}", **{"call_s": 3, "grace_s": 2, **kw})
    return out


def test_each_misbehaviour_is_caught_and_classified():
    cases = {
        "clean_refusal": "exit 2", "success": "exit 0", "two_error_lines": "bad error line",
        "unnamed_input": "bad error line", "exit_one": "other exit", "raises": "traceback",
        "printed_traceback": "traceback", "loops_forever": "hang", "ignores_the_alarm": "hang",
        "killed": "died", "exits_hard": "died",
    }
    results = run_entries(list(cases))
    got = {r.call.note: r.outcome() for r in results}
    assert got == cases
    for r in results:
        assert (r.problem() is None) == (cases[r.call.note] in ("exit 0", "exit 2")), (r.call.note, r.problem())
    by_name = {r.call.note: r for r in results}
    assert "KeyError: 'escaped main'" in by_name["raises"].traceback
    assert "loops_forever" in by_name["loops_forever"].traceback  # where it hung
    assert "killed" in by_name["ignores_the_alarm"].traceback  # past the alarm: killed by the server
    assert "signal 9" in by_name["killed"].traceback


def test_memory_is_bounded_per_call_and_measured_per_call():
    """A call that grows without bound hits the address-space limit (a MemoryError, so a
    traceback) instead of the machine; a call's peak is its own, not its predecessor's."""
    grown, peaked, after = run_entries(["grows", "peaks", "success"], as_bytes=3 << 30, call_s=60)
    assert grown.outcome() == "traceback" and "MemoryError" in grown.traceback
    assert peaked.outcome() == "exit 0" and peaked.peak_rss > after.peak_rss + 200 * MiB
    bounded = run_batch([call("peaks")], entry=f"{ME}:peaks", call_s=3, peak_bound=after.peak_rss + 128 * MiB)[0]
    assert bounded.outcome() == "bound exceeded" and "peak RSS" in bounded.problem()


def test_a_call_cannot_leak_into_the_next():
    changed, clean = run_entries(["changes_its_process", "sees_a_clean_process"])
    assert changed.outcome() == "exit 0" and clean.outcome() == "exit 0"


def test_victims_and_the_summary(tmp_path, monkeypatch):
    v = Victims()
    sentinel = v.sentinel(tmp_path / "victim")
    assert v.damaged() == []
    sentinel.write_text("changed")
    assert len(v.damaged()) == 1 and "victim changed" in v.damaged()[0]
    report = tmp_path / "report.jsonl"
    monkeypatch.setenv("COLIBRI_FUZZ_REPORT", str(report))
    run_entries(["clean_refusal", "success", "raises"])
    summary = summarize(report)
    assert summary["by_kind"] == {"harness": {"exit 2": 1, "exit 0": 1, "traceback": 1}}
    assert summary["calls"] == 3
