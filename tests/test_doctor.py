"""`colibri doctor`: each rule on a constructed situation (it speaks up when it should and is
quiet when it cannot know), the readings behind them on real files and fake sysfs trees, and the
command end to end on a tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.base.config import EngineConfig
from tuner.doctor import rules
from tuner.doctor.facts import cpu_freq_ratio, extent_count, gather, o_direct_read, throttle_events
from tuner.doctor.rules import Facts, diagnose

from colibri_tiny import make_tiny

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30


def severities(facts: Facts, rule) -> list[str]:
    return [f.severity for f in rule(facts)]


def test_a_rule_without_its_fact_says_nothing():
    assert diagnose(Facts()).findings == []
    assert diagnose(Facts()).verdict().startswith("ready")


@pytest.mark.parametrize("rule, quiet, loud, expect", [
    (rules.disk_space, dict(model_bytes=100 * GiB, disk_free_bytes=80 * GiB),
     dict(model_bytes=100 * GiB, disk_free_bytes=10 * GiB), "warn"),
    (rules.memory, dict(mem_total_bytes=64 * GiB, mem_available_bytes=60 * GiB),
     dict(mem_total_bytes=25 * GiB, mem_available_bytes=16 * GiB), "warn"),
    (rules.o_direct, dict(o_direct=True), dict(o_direct=False, o_direct_error="Invalid argument"), "warn"),
    (rules.fragmentation, dict(extents_per_gib=8.0), dict(extents_per_gib=900.0, worst_file="x"), "warn"),
    (rules.ssd, dict(iops_4k=400_000.0, qd1_latency_us=80.0), dict(iops_4k=18_000.0, iops_source="fio"), "warn"),
    (rules.native_kernels, dict(native_checked=True), dict(native_checked=True, native_error="no g++",
                                                           model_dtype="bf16"), "warn"),
    (rules.cgroup, dict(cgroup_available=True), dict(cgroup_available=False, cgroup_reason="not root"), "warn"),
    (rules.throttling, dict(freq_ratio=0.98, throttle_events=0), dict(freq_ratio=0.4), "warn"),
    (rules.huge_pages, dict(thp_mode="madvise"), dict(thp_mode="never"), "warn"),
    (rules.budget, dict(budget_bytes=GiB, plan_fixed_bytes=300 << 20, plan_cache_bytes=600 << 20),
     dict(budget_bytes=64 << 20, plan_error="memory budget 64 MiB is too small"), "problem"),
    (rules.drafting, dict(draft_acceptance=0.7, draft_best_speedup=1.4, draft_best_depth=3),
     dict(draft_acceptance=0.7, draft_best_speedup=0.8, draft_best_depth=1, draft_union=1.9,
          draft_bytes_per_token=3 << 30), "warn"),
])
def test_each_rule_is_quiet_when_fine_and_speaks_when_not(rule, quiet, loud, expect):
    assert set(severities(Facts(**quiet), rule)) <= {"ok"}
    findings = rule(Facts(**loud))
    assert expect in [f.severity for f in findings]
    bad = next(f for f in findings if f.severity == expect)
    assert bad.symptom and bad.cause and bad.fix  # a measured symptom, a cause, a fix


def test_swap_in_use_and_slow_qd1_latency_are_warned():
    assert "warn" in severities(Facts(swap_used_bytes=2 * GiB), rules.memory)
    assert "warn" in severities(Facts(qd1_latency_us=450.0), rules.ssd)


def test_native_fallback_is_fine_for_a_cpu_without_the_instructions_and_a_non_bf16_model():
    f = rules.native_kernels(Facts(native_checked=True, native_error="no avx512_bf16", model_dtype="f32",
                                   cpu_has_avx512_bf16=False))
    assert [x.severity for x in f] == ["ok"]


def test_the_verdict_names_the_first_problem():
    d = diagnose(Facts(budget_bytes=1, plan_error="memory budget 1 B is too small", cgroup_available=False,
                       cgroup_reason="x"))
    assert d.verdict().startswith("not ready: 1 problem(s), 1 warning(s); first: memory budget 1 B")


def test_extents_and_o_direct_readings_on_real_files(tmp_path):
    f = tmp_path / "w.bin"
    f.write_bytes(os.urandom(1 << 20))
    os.fsync(os.open(f, os.O_RDONLY))
    count = extent_count(f)
    if count is None:
        pytest.skip("this filesystem has no FIEMAP")
    assert count >= 1
    assert o_direct_read(f) is None  # ext4/xfs under the test's tmp dir take direct reads
    assert isinstance(o_direct_read(tmp_path), str)  # a read that fails (a directory) is reported, not raised


def test_frequency_and_throttle_readings_from_a_sysfs_tree(tmp_path):
    for i, (cur, mx, thr) in enumerate([(1_500_000, 3_000_000, 3), (2_900_000, 3_000_000, 4)]):
        d = tmp_path / f"cpu{i}"
        (d / "cpufreq").mkdir(parents=True)
        (d / "cpufreq" / "scaling_cur_freq").write_text(f"{cur}\n")
        (d / "cpufreq" / "cpuinfo_max_freq").write_text(f"{mx}\n")
        (d / "thermal_throttle").mkdir()
        (d / "thermal_throttle" / "core_throttle_count").write_text(f"{thr}\n")
    assert cpu_freq_ratio(tmp_path) == 0.5
    assert throttle_events(tmp_path) == 7
    assert cpu_freq_ratio(tmp_path / "none") is None and throttle_events(tmp_path / "none") is None


def test_gather_on_a_tiny_model_plans_the_budget(tmp_path):
    model = make_tiny(tmp_path / "tiny")
    ok = gather(model, EngineConfig(ram_budget=GiB), None)
    assert ok.plan_error is None and ok.plan_cache_bytes > 0 and ok.model_bytes > 0
    tight = gather(model, EngineConfig(ram_budget=64 << 20), None)
    assert "too small" in tight.plan_error


def test_doctor_command_json_and_exit_code(tmp_path):
    model = make_tiny(tmp_path / "tiny")

    def doctor(*extra):
        return subprocess.run([sys.executable, "-m", "colibri.cli", "doctor", "--model", str(model), "--json", *extra],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)

    good = doctor("--ram-budget", "1GiB")
    assert good.returncode == 0, good.stderr
    doc = json.loads(good.stdout)
    assert {f["rule"] for f in doc["findings"]} >= {"memory", "o_direct", "cgroup", "budget", "native_kernels"}
    bad = doctor("--ram-budget", "64MiB")
    assert bad.returncode == 1
    assert json.loads(bad.stdout)["verdict"].startswith("not ready")


# --- a conversation's KV (doctor --conversation-tokens N) --------------------------------------------

@pytest.mark.parametrize("facts, severity, says", [
    (dict(conversation_tokens=8000, conversation_error="memory budget 1 GiB is too small"), "problem",
     "a conversation of 8000 tokens does not fit"),
    (dict(conversation_tokens=8000, conversation_kv_bytes=800 << 20, prefix_cache_bytes=256 << 20,
          kv_disk_bytes=8 * GiB, kv_disk_free_bytes=100 * GiB, kv_restore_seconds=0.4), "warn",
     "holds 2560 tokens of KV"),
    (dict(conversation_tokens=8000, conversation_kv_bytes=100 << 20, prefix_cache_bytes=256 << 20,
          kv_disk_bytes=8 * GiB, kv_disk_free_bytes=100 * GiB), "ok", "holds 2 conversation(s) of 8000 tokens"),
])
def test_the_conversation_rule_says_whether_the_budget_holds_its_kv(facts, severity, says):
    [finding] = rules.conversation(Facts(**facts))
    assert finding.severity == severity and says in finding.symptom
    if severity != "ok":
        assert finding.cause and finding.fix


def test_the_conversation_rule_says_what_the_ssd_tier_gives():
    base = dict(conversation_tokens=8000, conversation_kv_bytes=800 << 20, prefix_cache_bytes=256 << 20)
    [tier] = rules.conversation(Facts(**base, kv_disk_bytes=8 * GiB, kv_disk_free_bytes=100 * GiB,
                                      kv_restore_seconds=0.4))
    assert "keeps 10 such conversation(s), each read back in ~0.4 s" in tier.fix and "after a restart" in tier.fix
    [full] = rules.conversation(Facts(**base, kv_disk_bytes=8 * GiB, kv_disk_free_bytes=1 * GiB))
    assert "keeps 1 such conversation(s)" in full.fix  # the disk's free room bounds the tier too
    [off] = rules.conversation(Facts(**base, kv_disk_bytes=0))
    assert "the SSD tier is off" in off.fix
    assert rules.conversation(Facts()) == []  # not asked: nothing said


def test_gather_reads_a_conversations_kv_from_the_plan(tmp_path):
    model = make_tiny(tmp_path / "tiny")
    config = EngineConfig(ram_budget=GiB, prefix_cache=1 << 20)
    small = gather(model, None, None, (config, 256, 8 * GiB, tmp_path / "kv" / "sub"))
    large = gather(model, None, None, (config, 1024, 8 * GiB, tmp_path / "kv"))
    assert small.conversation_error is None and 0 < small.conversation_kv_bytes
    assert large.conversation_kv_bytes == 4 * small.conversation_kv_bytes  # every position of every layer
    assert small.kv_disk_free_bytes > 0 and small.prefix_cache_bytes == 1 << 20
    refused = gather(model, None, None, (config.replace(ram_budget=64 << 20), 1024, 8 * GiB, tmp_path))
    assert "too small" in refused.conversation_error
    [finding] = rules.conversation(small)
    assert finding.rule == "conversation"


def test_doctor_command_checks_a_conversation(tmp_path):
    model = make_tiny(tmp_path / "tiny")
    out = subprocess.run([sys.executable, "-m", "colibri.cli", "doctor", "--model", str(model), "--ram-budget", "1GiB",
                          "--conversation-tokens", "400", "--prefix-cache", "0", "--json"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    [finding] = [f for f in json.loads(out.stdout)["findings"] if f["rule"] == "conversation"]
    assert finding["severity"] == "warn" and "a conversation of 400 tokens needs" in finding["symptom"]


def test_doctor_says_when_drafting_loses_on_this_machine(tmp_path):
    """The cost model behind the drafting rule: resident at the doctor's assumed acceptance a
    verify's rows share their weight reads and drafting pays; streaming demo from the disk with
    a small cache at low acceptance, the union of the rows' experts costs more than the accepted
    tokens save, at every depth."""
    from tests.test_probe_profile import make_profile
    from tuner.costmodel.hardware import HardwareView
    from tuner.costmodel.model_geometry import resolve
    from tuner.costmodel.predict import Factors, RunConditions
    from tuner.costmodel.routing_model import make_routing
    from tuner.costmodel.speculative import draft_prediction
    model = make_tiny(tmp_path / "tiny")
    profile = make_profile()
    resident = gather(model, EngineConfig(), profile)
    assert resident.draft_best_speedup > 1.0
    assert [f.severity for f in rules.drafting(resident)] == ["ok"]
    g = resolve("demo")
    streamed = draft_prediction(g, g.native_quant, EngineConfig(ram_budget=1 << 30, draft_depth=4),
                                HardwareView(profile), make_routing("uniform", g), Factors(),
                                RunConditions.steady(), 200 << 20, 0.3)
    assert streamed["best_depth"] == 0 and streamed["gate"].startswith("off")
    assert all(d["union"] > 1.0 and d["speedup"] < 1.0 for d in streamed["depths"])


def test_the_native_finding_names_the_build_that_loaded_and_expects_torch_only_without_avx2():
    f = rules.native_kernels(Facts(native_checked=True, native_error=None, native_build="avx2"))
    assert [x.severity for x in f] == ["ok"] and "AVX2 build" in f[0].symptom
    assert "AVX-512" in rules.native_kernels(Facts(native_checked=True, native_build="avx512"))[0].symptom
    lacking = dict(native_checked=True, native_error="this CPU lacks avx512_bf16", model_dtype="bf16",
                   cpu_has_avx512_bf16=False)
    assert "install g++" in rules.native_kernels(Facts(**lacking, cpu_has_avx2=True))[0].fix
    assert "fallback is expected" in rules.native_kernels(Facts(**lacking, cpu_has_avx2=False))[0].fix
