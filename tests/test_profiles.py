"""Shareable profiles: export → import → list/show round trip, privacy of an exported profile
of this machine, strict import (one test per class of bad profile), diff."""

from __future__ import annotations

import copy
import getpass
import ipaddress
import json
import re
import socket
from pathlib import Path

import psutil
import pytest

from report_fixture import GEOMETRY, hardware_profile, make_run
from colibri import cli
from tuner.share import profiles
from tuner.probe.probe_errors import ProfileError
from tuner.probe.hardware_profile import compute_fingerprint
from tuner.share.profile_schema import geometry_hash

MiB = 1 << 20


@pytest.fixture(autouse=True)
def store(tmp_path, monkeypatch) -> Path:
    """Every test gets its own XDG config home: the user's real store is never touched."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "colibri" / "profiles"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("profiles") / "run")


@pytest.fixture(scope="module")
def shared(run_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("shared") / "box.json"
    assert cli.main(["profile", "export", str(run_dir), "-o", str(path)]) == 0
    return path


def run_cli(args, capsys) -> tuple[int, str, str]:
    rc = cli.main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


# --- round trip -----------------------------------------------------------------------------

def test_export_import_show_round_trip(shared, store, capsys):
    data = json.loads(shared.read_text())
    (entry,) = data["best_configs"]
    assert entry["model"] == "tiny" and entry["geometry_hash"] == geometry_hash(GEOMETRY)
    assert entry["quant"] == "fp32" and entry["ram_budget"] == 512 * MiB and entry["objective"] == "decode"
    assert entry["figures"]["decode_tok_s"] == pytest.approx(427.5)
    assert entry["figures"]["decode_min"] == pytest.approx(384.75)
    assert entry["figures"]["bytes_read_per_token"] == pytest.approx(38000.0)  # the search trial's (trials.csv)
    assert entry["conditions"]["cold"] is True and entry["conditions"]["tokens"] == 4
    assert entry["tool"]["git_commit"] == "32851d055f65" and entry["config"]["io_mode"] == "mmap"

    rc, out, _ = run_cli(["profile", "import", str(shared)], capsys)
    assert rc == 0 and out.startswith("imported ")
    name = out.split()[1]
    assert json.loads((store / f"{name}.json").read_text()) == data
    rc, out, _ = run_cli(["profile", "import", str(shared)], capsys)
    assert rc == 0 and "already in the store" in out
    rc, out, _ = run_cli(["profile", "list", "--json"], capsys)
    assert [r["name"] for r in json.loads(out)] == [name]
    rc, out, _ = run_cli(["profile", "show", name, "--json"], capsys)
    assert json.loads(out) == data
    rc, out, _ = run_cli(["profile", "show", name], capsys)
    assert "Fixture CPU 9000" in out and "tiny [" in out and "427.50 tok/s" in out and "mmap x16" in out


def test_exported_profile_warm_starts_tune(shared):
    """The shared form stays a HardwareProfile: `tune --profile/--from-profile` read it."""
    from tuner.probe import load_profile
    prof = load_profile(shared)
    assert prof.best_configs[0]["geometry"]["experts"] == 8 and prof.best_configs[0]["config"]["chunk_size"] == 262144


def test_export_from_probe_json_and_name_clash(tmp_path, store, capsys):
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(hardware_profile().to_dict()))
    out = tmp_path / "p.json"
    assert run_cli(["profile", "export", str(probe), "-o", str(out)], capsys)[0] == 0
    assert json.loads(out.read_text())["best_configs"] == []
    assert run_cli(["profile", "import", str(out), "--name", "mine"], capsys)[0] == 0
    other = tmp_path / "other.json"
    other.write_text(json.dumps(hardware_profile(cpu_model="Other CPU").to_dict()))
    rc, _, err = run_cli(["profile", "import", str(other), "--name", "mine"], capsys)
    assert rc == 2 and "already in" in err
    assert run_cli(["profile", "import", str(other), "--name", "mine", "--force"], capsys)[0] == 0
    assert "Other CPU" in (store / "mine.json").read_text()


# --- privacy --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def this_machine_run(profile_path, tmp_path_factory) -> Path:
    """A run directory whose profile.json is a real (shrunk) probe of this machine and whose
    result names absolute paths, as a real run's does."""
    from tuner.probe import load_profile
    return make_run(tmp_path_factory.mktemp("privacy") / "run", profile=load_profile(profile_path),
                    model_dir=str(Path.home() / "models" / "tiny"))


def _identifiers() -> dict[str, set[str]]:
    """What would identify this machine or its user, read from the machine itself."""
    found: dict[str, set[str]] = {"hostname": {socket.gethostname(), socket.getfqdn()}, "user": {getpass.getuser()},
                                  "serial": set(), "mac": set(), "ip": set()}
    for pattern in ("/sys/block/*/device/serial", "/sys/block/*/serial", "/sys/block/*/device/wwid",
                    "/sys/class/dmi/id/*serial*", "/sys/class/dmi/id/product_uuid", "/etc/machine-id"):
        for p in Path("/").glob(pattern.lstrip("/")):
            try:
                value = p.read_text().strip()
            except OSError:
                continue
            if len(value) >= 4:
                found["serial"].add(value)
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == psutil.AF_LINK and a.address and a.address.strip("0:"):
                found["mac"].add(a.address.lower())
            elif a.family in (socket.AF_INET, socket.AF_INET6):
                found["ip"].add(a.address.split("%")[0])
    return found


def _strings(value):
    if isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def _leaks(data: dict) -> dict[str, list[str]]:
    strings = list(_strings(data))
    text = json.dumps(data).lower()
    leaks: dict[str, list[str]] = {}
    for kind, values in _identifiers().items():
        for v in values:
            # Whole words only: a two-letter hostname must not match inside "avx2".
            if v and re.search(rf"(?<![\w.-]){re.escape(v.lower())}(?![\w-])", text):
                leaks.setdefault(kind, []).append(v)
    paths = [s for s in strings if s.startswith(("/", "~")) or re.match(r"^[A-Za-z]:\\", s) or "/home/" in s
             or str(Path.home()) in s]
    if paths:
        leaks["path"] = paths
    for s in strings:
        try:
            ipaddress.ip_address(s)
            leaks.setdefault("ip", []).append(s)
        except ValueError:
            pass
    return leaks


def test_exported_profile_of_this_machine_keeps_no_identity(this_machine_run, tmp_path):
    raw = json.loads((this_machine_run / "profile.json").read_text())
    result = json.loads((this_machine_run / "result.json").read_text())
    # The inputs do carry paths (model dir, routing histogram): the export must drop them.
    assert result["model"]["dir"].startswith(str(Path.home()))
    assert result["recommended"]["config"]["routing_histogram"].startswith("/")
    assert raw["system"]["cpu"]["model"]
    exported = profiles.export_profile(this_machine_run)
    assert _leaks(exported) == {}
    assert exported["best_configs"][0]["model"] == "tiny"
    assert exported["best_configs"][0]["config"]["routing_histogram"] == ""


def test_include_identity_keeps_it(this_machine_run):
    """The leak check can see identity when it is there (so the test above can fail)."""
    exported = profiles.export_profile(this_machine_run, include_identity=True)
    leaks = _leaks(exported)
    assert socket.gethostname() in leaks["hostname"] and "path" in leaks
    assert exported["identity"]["model_dirs"] == [str(Path.home() / "models" / "tiny")]
    profiles.validate_shared(exported)


def test_tune_reads_a_profile_exported_with_identity(this_machine_run, tmp_path):
    """`tune --profile/--from-profile` (and `plan --profile`) accept the identity block: allowed,
    not required, and left out of what the run keeps."""
    from tuner.search.preflight import probe_profile
    from tuner.results.outputs import warm_start_entry
    path = profiles.write_profile_file(profiles.export_profile(this_machine_run, include_identity=True),
                                       tmp_path / "mine.json")
    assert "identity" in json.loads(path.read_text())
    run = tmp_path / "run"
    run.mkdir()
    profile, source = probe_profile(run, str(path), this_machine_run, log=lambda m: None)
    assert source == str(path) and profile.fingerprint == json.loads(path.read_text())["fingerprint"]
    assert "identity" not in json.loads((run / "profile.json").read_text())
    entry = warm_start_entry(str(path), profile.best_configs[0]["geometry"], log=lambda m: None)
    assert entry["config"] == profile.best_configs[0]["config"]
    bad = json.loads(path.read_text())
    bad["identity"] = "me"
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match="identity must be an object"):
        probe_profile(run, str(tmp_path / "bad.json"), this_machine_run, log=lambda m: None)


# --- strict import: one test per class of bad profile ---------------------------------------

def _refit(d: dict) -> dict:
    """Recompute the fingerprint after a hardware edit, so the edit under test is what fails."""
    from tuner.probe.hardware_profile import GpuInfo, SystemInfo, _decode
    system = _decode(SystemInfo, d["system"], "system")
    gpus = [_decode(GpuInfo, g, "gpu") for g in d["gpus"]]
    d["fingerprint"] = compute_fingerprint(system, gpus)
    return d


def _set(path: str, value, refit: bool = False):
    def edit(d):
        node = d
        keys = path.split(".")
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        last = keys[-1]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
        return _refit(d) if refit else d
    return edit


def _del(path: str):
    def edit(d):
        node = d
        keys = path.split(".")
        for k in keys[:-1]:
            node = node[int(k)] if isinstance(node, list) else node[k]
        del node[keys[-1]]
        return d
    return edit


BAD = {
    "wrong schema_version": (_set("schema_version", 2), "schema_version 2 is not supported"),
    "unknown key": (_set("system.cpu.owner", "me"), "unknown key 'owner'"),
    "missing key": (_del("storage.method"), "missing key 'method'"),
    "wrong type": (_set("system.cpu.physical_cores", "2"), "profile.system.cpu.physical_cores: expected integer"),
    "wrong unit": (_set("storage.points.0.bandwidth.unit", "MB/s"), "expected 'B/s', got 'MB/s'"),
    "negative value": (_set("storage.points.1.bandwidth.value", -1.0), "must not be negative"),
    "out of range": (_set("system.cpu.physical_cores", 0, refit=True), "outside the plausible range"),
    "implausible figure": (_set("storage.points.1.bandwidth.value", 5e15), "outside the plausible range"),
    "fingerprint mismatch": (_set("system.cpu.model", "Faster CPU"), "does not match the hardware"),
    "long string": (_set("storage.tool", "x" * 5000), "string of 5000 characters"),
    "control characters": (_set("system.cpu.model", "EPYC\x1b]0;pwned\x07", refit=True), "control characters"),
    "too many items": (lambda d: {**d, "gpus": [d["gpus"][0] if d["gpus"] else {}] * 600}, "array of 600 items"),
    "too deep": (_set("best_configs", [{"a": [[[[[[[[[[[[1]]]]]]]]]]]]}]), "nested deeper than"),
    "entry: unknown schema": (_set("best_configs.0.schema", "evil/1"), "best_configs[0].schema"),
    "entry: bad config": (_set("best_configs.0.config.io_mode", "turbo"), "io_mode must be one of"),
    "entry: config key": (_set("best_configs.0.config.shell", "rm -rf /"), "unknown key(s) shell"),
    "entry: path as model": (_set("best_configs.0.model", "/home/alice/models/x"), "a model name, not a path"),
    "entry: geometry hash": (_set("best_configs.0.geometry.experts", 9), "geometry_hash: does not match"),
    "entry: quant": (_set("best_configs.0.quant", "int3"), "best_configs[0].quant"),
    "entry: figure range": (_set("best_configs.0.figures.decode_tok_s", -5), "outside [0, 1e+09]"),
    "entry: fraction range": (_set("best_configs.0.figures.hit_rate_ram", 1.5), "outside [0, 1]"),
    "entry: missing conditions": (_del("best_configs.0.conditions"), "missing key 'conditions'"),
    "identity: wrong type": (_set("identity", {"hostname": 7, "user": None, "model_dirs": []}),
                             "identity.hostname: expected string"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_import_rejects_bad_profile(case, shared, tmp_path, store, capsys):
    edit, message = BAD[case]
    data = edit(copy.deepcopy(json.loads(shared.read_text())))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    rc, out, err = run_cli(["profile", "import", str(bad)], capsys)
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("colibri profile: error: ") and message in lines[0], lines
    assert not store.exists() or list(store.iterdir()) == []


@pytest.mark.parametrize("case,text,message", [
    ("not JSON", b"{not json", "not valid JSON"),
    ("not an object", b"[1, 2]", "expected a JSON object"),
    ("NaN", b'{"schema_version": NaN}', "NaN is not valid JSON"),
    ("duplicate key", b'{"schema_version": 1, "schema_version": 1}', "duplicate key 'schema_version'"),
    ("not UTF-8", b'{"a": "\xff\xfe"}', "not UTF-8"),
    ("too big", b'{"pad": "' + b"x" * (1 << 20) + b'"}', "over the 1048576-byte limit"),
])
def test_import_rejects_malformed_file(case, text, message, tmp_path, store, capsys):
    bad = tmp_path / "bad.json"
    bad.write_bytes(text)
    rc, _, err = run_cli(["profile", "import", str(bad)], capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and message in lines[0], lines
    assert not store.exists() or list(store.iterdir()) == []


# --- diff -----------------------------------------------------------------------------------

def test_diff_shows_hardware_and_best_configs_side_by_side(shared, tmp_path, capsys):
    other_run = make_run(tmp_path / "other", speed=2.0, profile=hardware_profile("Other CPU 2", seq_gbps=3.5))
    other = tmp_path / "other.json"
    assert cli.main(["profile", "export", str(other_run), "-o", str(other)]) == 0
    capsys.readouterr()
    rc, out, _ = run_cli(["profile", "diff", str(shared), str(other), "--json"], capsys)
    d = json.loads(out)
    differs = {h["item"] for h in d["hardware"] if h["differs"]}
    assert {"fingerprint", "cpu", "sequential read", "1 MiB QD4 random read"} <= differs
    assert "RAM" not in differs and "cores" not in differs
    (pair,) = d["configs"]
    assert pair["same_conditions"] and pair["quant"] == "fp32"
    assert pair["b"]["figures"]["decode_tok_s"] == pytest.approx(2 * pair["a"]["figures"]["decode_tok_s"])
    rc, out, _ = run_cli(["profile", "diff", str(shared), str(other)], capsys)
    assert rc == 0 and "* cpu" in out and "Other CPU 2" in out and "855.00 tok/s" in out


# --- the shipped example ----------------------------------------------------------------------

def test_shipped_profiles_import_strictly_and_identify_no_one(tmp_path, store):
    """profiles/*.json: what a stranger downloads. Each passes strict import, carries no
    identity (no `identity` block, no absolute path, no hostname or user of the tuning box, no
    routing-histogram path), and the README's table lists it."""
    root = Path(__file__).resolve().parent.parent / "profiles"
    shipped = sorted(root.glob("*.json"))
    assert shipped, "profiles/ ships an example profile"
    readme = (root / "README.md").read_text()
    for path in shipped:
        data = profiles.read_profile_file(path)
        assert "identity" not in data and data["best_configs"], path
        strings = list(_strings(data))
        assert not [s for s in strings if s.startswith(("/", "~")) or "/home/" in s or "/root/" in s], path
        for e in data["best_configs"]:
            assert e["config"]["routing_histogram"] == "" and "/" not in e["model"]
        assert f"`{path.name}`" in readme
        assert profiles.import_profile(path)[2] is True  # the store accepts it as is


def test_shipped_profile_carries_fitted_cost_model_factors_through_export_and_import(tmp_path, store, capsys):
    """The shipped profile's `cost_model` (factors fitted on this box's demo study) is what
    `colibri plan --profile` uses, and export → import keeps it unchanged."""
    from tuner.costmodel.fit import factors_from_profile
    from tuner.probe.hardware_profile import load_profile
    path = Path(__file__).resolve().parent.parent / "profiles" / "amd-epyc-virtio-2a91f032.json"
    factors = factors_from_profile(load_profile(path))
    assert factors is not None and factors.eta_io > 0 and factors.c_page_mmap > 0
    exported = tmp_path / "out.json"
    assert cli.main(["profile", "export", str(path), "-o", str(exported)]) == 0
    name, stored, _ = profiles.import_profile(exported)
    assert json.loads(stored.read_text())["cost_model"] == json.loads(path.read_text())["cost_model"]
    assert factors_from_profile(load_profile(stored)) == factors
    capsys.readouterr()
    assert cli.main(["plan", "--model", "demo", "--profile", str(stored), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["calibrated"] is True and out["factors"]["eta_io"] == pytest.approx(factors.eta_io)
