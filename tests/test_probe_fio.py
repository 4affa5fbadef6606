"""fio: argv construction and JSON parsing against real fio 3.33 output captured on the dev
machine (tests/fixtures/fio/*.json, produced by `job_argv` command lines), plus short real runs
when fio is installed."""

import json
import os
import shutil
from pathlib import Path

import pytest

from tuner.probe import fio
from tuner.probe.probe_errors import ProbeError
from tuner.probe.storage import KiB, MiB, StorageJob, scratch_file
from colibri_requirements import needs

FIXTURES = Path(__file__).parent / "fixtures" / "fio"
needs_fio = pytest.mark.skipif(shutil.which("fio") is None, reason=needs("fio", "fio is not installed"))

CASES = {
    "randread_64k_qd4_io_uring": StorageJob("curve", "randread", 64 * KiB, 4),
    "read_1m_qd32_libaio": StorageJob("sequential", "read", 1 * MiB, 32),
    "randread_4k_qd4_psync": StorageJob("iops_4k", "randread", 4 * KiB, 4),
    "randread_1m_qd4_buffered_once": StorageJob("buffered", "randread", 1 * MiB, 4,
                                                direct=False, time_based=False),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_parse_real_fio_output(name):
    text = (FIXTURES / f"{name}.json").read_text()
    job = CASES[name]
    pt = fio.point_from_result(fio.parse_fio_output(text), job)
    raw = json.loads(text)["jobs"][0]["read"]
    assert pt.role == job.role and pt.request_bytes == job.request_bytes
    assert pt.queue_depth == job.queue_depth and pt.direct == job.direct
    assert pt.bandwidth.value == raw["bw_bytes"] and pt.bandwidth.unit == "B/s"
    assert pt.iops.value == pytest.approx(raw["iops"])
    assert pt.runtime.value == raw["runtime"] / 1000
    # Total latency (submission + completion), in µs, from the lat_percentiles block.
    assert pt.lat_p50.value == raw["lat_ns"]["percentile"]["50.000000"] / 1000
    assert pt.lat_p99.value == raw["lat_ns"]["percentile"]["99.000000"] / 1000
    assert pt.lat_mean.value == pytest.approx(raw["lat_ns"]["mean"] / 1000)
    # Internal consistency of what we read: bandwidth = IOPS x request size, p50 <= p99.
    assert pt.bandwidth.value == pytest.approx(pt.iops.value * job.request_bytes, rel=0.01)
    assert 0 < pt.lat_p50.value <= pt.lat_p99.value


def test_fixtures_were_made_by_our_command_lines():
    """The captured runs used the options job_argv emits, so parsing them is meaningful."""
    opts = json.loads((FIXTURES / "randread_4k_qd4_psync.json").read_text())["jobs"][0][
        "job options"]
    assert opts["ioengine"] == "psync" and opts["numjobs"] == "4"
    assert opts["lat_percentiles"] == "1" and opts["allow_file_create"] == "0"
    buffered = json.loads((FIXTURES / "randread_1m_qd4_buffered_once.json").read_text())[
        "jobs"][0]["job options"]
    assert buffered["direct"] == "0" and "time_based" not in buffered


def test_fio_error_in_json_is_reported():
    text = (FIXTURES / "error_missing_file.json").read_text()
    with pytest.raises(ProbeError, match=r"failed with error 2 \(No such file or directory\)"):
        fio.point_from_result(fio.parse_fio_output(text), CASES["randread_64k_qd4_io_uring"])


def test_parse_skips_notes_printed_before_the_json():
    text = ("note: both iodepth >= 1 and synchronous I/O engine are selected\n"
            + (FIXTURES / "randread_64k_qd4_io_uring.json").read_text())
    assert fio.parse_fio_output(text)["jobs"][0]["jobname"] == "colibri-probe"


@pytest.mark.parametrize("text, message", [
    ("", "no JSON output"),
    ("fio: something\n{ broken", "malformed JSON"),
    ('{"jobs": []}', "no jobs"),
])
def test_parse_rejects_unusable_output(text, message):
    with pytest.raises(ProbeError, match=message):
        fio.parse_fio_output(text)


def test_missing_fields_are_a_probe_error():
    doc = json.loads((FIXTURES / "randread_64k_qd4_io_uring.json").read_text())
    del doc["jobs"][0]["read"]["bw_bytes"]
    with pytest.raises(ProbeError, match="lacks an expected field"):
        fio.point_from_result(doc, CASES["randread_64k_qd4_io_uring"])


# --- argv -----------------------------------------------------------------------------------

def test_argv_for_async_and_sync_engines():
    job = StorageJob("curve", "randread", 1 * MiB, 16)
    argv = fio.job_argv("fio", job, Path("/d/f.tmp"), 256 * MiB, 1.5, "io_uring")
    assert all(isinstance(a, str) for a in argv)
    assert "--iodepth=16" in argv and "--time_based" in argv and "--runtime=1500ms" in argv
    assert "--direct=1" in argv and "--readonly" in argv and "--bs=1048576" in argv
    sync = fio.job_argv("fio", job, Path("/d/f.tmp"), 256 * MiB, 1.5, "psync")
    assert "--numjobs=16" in sync and "--iodepth=1" in sync and "--group_reporting" in sync


def test_argv_escapes_colons_and_buffered_runs_once():
    job = StorageJob("buffered", "randread", 1 * MiB, 4, direct=False, time_based=False)
    argv = fio.job_argv("fio", job, Path("/mnt/a:b/f.tmp"), 64 * MiB, 1.0, "libaio")
    assert "--filename=/mnt/a\\:b/f.tmp" in argv
    assert "--direct=0" in argv and "--time_based" not in argv


def test_find_fio_honours_explicit_path_and_env(tmp_path, monkeypatch):
    script = tmp_path / "myfio"
    script.write_text("#!/bin/sh\necho fio-9.99\n")
    script.chmod(0o755)
    assert fio.find_fio(script) == str(script)
    monkeypatch.setenv(fio.FIO_ENV, str(script))
    assert fio.find_fio() == str(script)
    assert fio.fio_version(str(script)) == "fio-9.99"
    monkeypatch.setenv(fio.FIO_ENV, str(tmp_path / "absent"))
    assert fio.find_fio() is None


# --- real fio -------------------------------------------------------------------------------

@needs_fio
def test_real_fio_job_on_a_small_file(tmp_path):
    job = StorageJob("curve", "randread", 64 * KiB, 4)
    with scratch_file(tmp_path, 8 * MiB) as path:
        point, engine = fio.run_first_job("fio", job, path, 8 * MiB, 0.1)
        assert engine in fio.ENGINE_PREFERENCE
        again = fio.run_job("fio", job, path, 8 * MiB, 0.1, engine)
    for p in (point, again):
        assert p.bandwidth.value > 0 and p.iops.value > 0
        assert p.bandwidth.value == pytest.approx(p.iops.value * 64 * KiB, rel=0.01)


@needs_fio
def test_engine_fallback_chain_skips_engines_fio_cannot_load(tmp_path):
    job = StorageJob("latency_4k", "randread", 4 * KiB, 1)
    with scratch_file(tmp_path, 4 * MiB) as path:
        _, engine = fio.run_first_job("fio", job, path, 4 * MiB, 0.05,
                                      engines=("no_such_engine", "psync"))
    assert engine == "psync"


@needs_fio
def test_real_fio_failure_carries_fios_message(tmp_path):
    job = StorageJob("latency_4k", "randread", 4 * KiB, 1)
    with scratch_file(tmp_path, 4 * MiB) as path:
        with pytest.raises(ProbeError, match="engine no_such_engine not loadable") as err:
            fio.run_first_job("fio", job, path, 4 * MiB, 0.05, engines=("no_such_engine",))
    assert "\n" not in str(err.value)


@needs_fio
def test_real_fio_on_a_vanished_file_fails_clearly(tmp_path):
    job = StorageJob("curve", "randread", 64 * KiB, 1)
    with pytest.raises(ProbeError, match="fio failed on randread 64KiB QD1 direct: fio:"):
        fio.run_job("fio", job, tmp_path / "gone.tmp", 4 * MiB, 0.05, "psync")
    assert not os.path.exists(tmp_path / "gone.tmp")  # --allow_file_create=0 held
