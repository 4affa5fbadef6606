"""Property-based fuzzing of every file a user hands us: `colibri` succeeds or exits 2 with one line.

Mutated config.json values, safetensors headers (and the shard index), geometry files, engine
TOML files and profile / routing-histogram JSON. The property: the command exits 0, or exits 2
with exactly one stderr line `colibri <cmd>: error: ...` — never a traceback (an exception
escaping `main` fails the example), never a hang (a per-example time limit).

Most examples run the CLI in-process (`colibri.cli.main`: tens of ms each); a few go through a
real `python -m colibri.cli` subprocess so the installed entry path is covered too.

CI runs a bounded, derandomized set. `make fuzz` sets COLIBRI_FUZZ_EXAMPLES for a longer,
random campaign (and keeps Hypothesis's example database so a failure replays).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import synth
from engine.format.checkpoint import DTYPES
from engine.base.config import EngineConfig
from engine.base.errors import ColibriError
from engine.arch.registry import SUPPORTED_TYPES
from engine.arch.config_rules import ROPE_TYPES
from engine.arch.registry import RULES
from colibri_fuzz import record
from colibri_tiny import RUN_ARGS, TINY, make_tiny, read_header, write_header
from colibri.cli import main

ROOT = Path(__file__).resolve().parent.parent
CAMPAIGN = int(os.environ.get("COLIBRI_FUZZ_EXAMPLES", "0"))
LIMIT_S = 60  # per example; a normal one takes well under a second even on a loaded box


def fuzz(ci_examples: int, campaign_share: float = 1.0):
    """CI: ci_examples, derandomized. Campaign: COLIBRI_FUZZ_EXAMPLES x campaign_share, random."""
    examples = max(ci_examples, int(CAMPAIGN * campaign_share)) if CAMPAIGN else ci_examples
    return settings(max_examples=examples, deadline=None, derandomize=not CAMPAIGN,
                    database=None if not CAMPAIGN else settings.default.database, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


class ExampleHang(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    def on_alarm(signum, frame):
        raise ExampleHang(f"example still running after {seconds} s")
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def cli(*argv, kind: str) -> tuple[int, str, str]:
    """One in-process call; an exception escaping main (or a hang) is recorded for the campaign
    summary under `kind` (the input kind) and fails the example."""
    out, err = io.StringIO(), io.StringIO()
    try:
        with time_limit(LIMIT_S), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main([str(a) for a in argv])
    except BaseException as exc:
        record(kind, str(argv[0]), "hang" if isinstance(exc, ExampleHang) else "traceback")
        raise
    return code, out.getvalue(), err.getvalue()


def assert_clean_exit(code: int, err: str, command: str, kind: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    clean_error = code == 2 and len(lines) == 1 and lines[0].startswith(f"colibri {command}: error: ")
    record(kind, command, "traceback" if "Traceback" in err else "exit 0" if code == 0 else
           "exit 2" if clean_error else "bad error line" if code == 2 else "other exit")
    assert "Traceback" not in err, err
    if code == 0:
        return
    assert code == 2, (code, err)
    assert clean_error, err


# --- strategies --------------------------------------------------------------------------------

SPECIAL_INTS = [0, 1, 2, 3, 7, -1, -2, 15, 16, 300, 2**31, 2**63, -2**63, 10**30, 10**400]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.sampled_from(SPECIAL_INTS), st.integers(-10**6, 10**6),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=6),
    st.sampled_from(["", "8", "silu", "default", "linear", "yarn", "llama3", "float32", "1GiB"]))
ROPE_KEYS = ["rope_type", "type", "factor", "rope_theta", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"]
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(ROPE_KEYS) | st.text(max_size=4), inner, max_size=3),
                      max_leaves=6)
ROPE = st.dictionaries(st.sampled_from(ROPE_KEYS), st.one_of(
    st.sampled_from([*ROPE_TYPES, "longrope", "dynamic"]), st.sampled_from([0, 1, 2, 4.0, 64, 1e4, -1.0, 0.5]),
    SCALARS), max_size=6)
CONFIG_KEYS = sorted({r.name for rules in RULES.values() for r in rules if hasattr(r, "name")}
                     | {"model_type", "rope_scaling", "rope_parameters", "rope_theta"})


def config_mutation():
    return st.one_of(
        st.tuples(st.just("set"), st.sampled_from(CONFIG_KEYS), VALUES),
        st.tuples(st.just("del"), st.sampled_from(CONFIG_KEYS), st.none()),
        st.tuples(st.just("scale"), st.sampled_from(CONFIG_KEYS), st.sampled_from([0, -1, 2, 3, 1000, 0.5])),
        st.tuples(st.just("set"), st.sampled_from(["rope_scaling", "rope_parameters"]), ROPE),
        st.tuples(st.just("set"), st.just("model_type"), st.sampled_from([*SUPPORTED_TYPES, "gpt2", ""])))


def apply_config_mutations(cfg: dict, mutations) -> dict:
    cfg = json.loads(json.dumps(cfg))
    for op, key, value in mutations:
        if op == "del":
            cfg.pop(key, None)
        elif op == "scale":
            old = cfg.get(key)
            if isinstance(old, (int, float)) and not isinstance(old, bool):
                cfg[key] = old * value
        else:
            cfg[key] = value
    return cfg


def dump_json(obj, raw_cut: float | None) -> str:
    text = json.dumps(obj)  # NaN / Infinity literals included: json.loads accepts them, so must we
    return text if raw_cut is None else text[:int(len(text) * raw_cut)]


HEADER_OPS = st.one_of(
    st.tuples(st.just("dtype"), st.integers(0, 200), st.sampled_from([*DTYPES, "F8_E4M3", "int8", "", "bf16"])),
    st.tuples(st.just("shape"), st.integers(0, 200), st.one_of(
        st.lists(st.sampled_from([0, 1, 2, 8, 16, 32, 64, 300, -1, 2**40, 2**64]), max_size=4), VALUES)),
    st.tuples(st.just("swap_shape"), st.integers(0, 200), st.none()),
    st.tuples(st.just("offsets"), st.integers(0, 200), st.tuples(
        st.sampled_from([0, 1, -1, 4, -4, 4096, 2**40, -2**40]), st.sampled_from([0, 1, -1, 4, -4, 4096, 2**40]))),
    st.tuples(st.just("field"), st.integers(0, 200), st.tuples(
        st.sampled_from(["dtype", "shape", "data_offsets", "extra"]), VALUES)),
    st.tuples(st.just("delete"), st.integers(0, 200), st.none()),
    st.tuples(st.just("entry"), st.integers(0, 200), VALUES),
    st.tuples(st.just("nest"), st.integers(0, 200), st.integers(1, 5000)),
    st.tuples(st.just("metadata"), st.just(0), VALUES),
)
RAW_OPS = st.one_of(
    st.tuples(st.just("length"), st.one_of(st.integers(-64, 64), st.sampled_from([-10**6, 10**6, 2**40, 2**63]))),
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("append"), st.binary(max_size=64)),
    st.tuples(st.just("flip"), st.tuples(st.floats(0, 1), st.integers(0, 255))),
)


def mutate_header(header: dict, ops) -> dict | str:
    names = [k for k in header if k != "__metadata__"]
    for op, i, arg in ops:
        name = names[i % len(names)]
        entry = header.get(name)
        if not isinstance(entry, dict) and op in ("dtype", "shape", "swap_shape", "offsets", "field"):
            continue
        if op == "dtype":
            entry["dtype"] = arg
        elif op == "shape":
            entry["shape"] = arg
        elif op == "swap_shape" and isinstance(entry.get("shape"), list):
            entry["shape"] = entry["shape"][::-1]
        elif op == "offsets" and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2:
            b, e = entry["data_offsets"]
            entry["data_offsets"] = [b + arg[0], e + arg[1]]
        elif op == "field":
            entry[arg[0]] = arg[1]
        elif op == "delete":
            header.pop(name, None)
        elif op == "entry":
            header[name] = arg
        elif op == "nest":
            header[name] = "@NEST@"
            text = json.dumps(header)
            return text.replace('"@NEST@"', "[" * arg + "]" * arg)
        elif op == "metadata":
            header["__metadata__"] = arg
    return header


def apply_raw(path: Path, header_text: str, data: bytes, raw_ops) -> None:
    blob = header_text.encode()
    length = len(blob)
    for op, arg in raw_ops:
        if op == "length":
            length = max(0, min(2**64 - 1, length + arg if abs(arg) < 2**20 else arg if arg > 0 else length + arg))
    buf = bytearray(length.to_bytes(8, "little") + blob + data)
    for op, arg in raw_ops:
        if op == "truncate":
            buf = buf[:int(len(buf) * arg)]
        elif op == "append":
            buf += arg
        elif op == "flip" and buf:
            pos = min(len(buf) - 1, int((8 + len(blob)) * arg[0]))  # inside the prefix or the header
            buf[pos] = arg[1]
    path.write_bytes(bytes(buf))


# --- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _give_memory_back():
    """Hundreds of in-process engine loads leave freed heap in malloc's arenas; later tests that
    run the engine in-process under a budget measure this process's RSS as runtime overhead."""
    yield
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    return {"single": make_tiny(root / "single"), "sharded": make_tiny(root / "sharded", sharded=True)}


@contextlib.contextmanager
def copy_of(model: Path):
    with tempfile.TemporaryDirectory(prefix="colibri-fuzz-") as tmp:
        d = Path(tmp) / "m"
        shutil.copytree(model, d)
        yield d


# Resident (no budget) or streaming through the expert store in each I/O mode: a budget far above
# this process's size streams the experts of the tiny model through the RAM cache.
PLACEMENTS = st.sampled_from([(), ("--ram-budget", "8GiB", "--io-mode", "direct"),
                              ("--ram-budget", "8GiB", "--io-mode", "buffered"),
                              ("--ram-budget", "8GiB", "--io-mode", "mmap")])


def run_and_check(model: Path, *extra, kind: str) -> int:
    code, out, err = cli("run", "--model", model, *RUN_ARGS, "--json", *extra, kind=kind)
    assert_clean_exit(code, err, "run", kind)
    if code == 0:
        assert json.loads(out)["output_ids"]
    return code


# --- the properties ------------------------------------------------------------------------------

@fuzz(150)
@given(mutations=st.lists(config_mutation(), min_size=1, max_size=3),
       raw_cut=st.none() | st.floats(0, 1), sharded=st.booleans(), placement=PLACEMENTS)
def test_fuzz_config_json(base, mutations, raw_cut, sharded, placement):
    with copy_of(base["sharded" if sharded else "single"]) as d:
        cfg = apply_config_mutations(json.loads((d / "config.json").read_text()), mutations)
        (d / "config.json").write_text(dump_json(cfg, raw_cut))
        run_and_check(d, *placement, kind="config.json")


@fuzz(150)
@given(ops=st.lists(HEADER_OPS, max_size=3), raw_ops=st.lists(RAW_OPS, max_size=2),
       sharded=st.booleans(), shard_pick=st.integers(0, 10), placement=PLACEMENTS)
def test_fuzz_safetensors_header(base, ops, raw_ops, sharded, shard_pick, placement):
    with copy_of(base["sharded" if sharded else "single"]) as d:
        shards = sorted(d.glob("*.safetensors"))
        f = shards[shard_pick % len(shards)]
        header, data = read_header(f)
        mutated = mutate_header(header, ops)
        apply_raw(f, mutated if isinstance(mutated, str) else json.dumps(mutated), data, raw_ops)
        run_and_check(d, *placement, kind="safetensors header")


@fuzz(60)
@given(target=st.sampled_from(["weight_map", "entry", "index"]), key_pick=st.integers(0, 500), value=VALUES)
def test_fuzz_shard_index(base, target, key_pick, value):
    with copy_of(base["sharded"]) as d:
        path = d / "model.safetensors.index.json"
        index = json.loads(path.read_text())
        names = sorted(index["weight_map"])
        if target == "weight_map":
            index["weight_map"] = value
        elif target == "entry":
            index["weight_map"][names[key_pick % len(names)]] = value
        else:
            index = value
        path.write_text(json.dumps(index))
        run_and_check(d, kind="shard index")


@fuzz(40)
@given(mutations=st.lists(config_mutation(), min_size=1, max_size=3))
def test_fuzz_geometry_file(mutations):
    """A geometry that synth accepts must give a model that runs; one it refuses is one line."""
    geometry = apply_config_mutations({**TINY, "max_shard_size": 1 << 30}, mutations)
    with tempfile.TemporaryDirectory(prefix="colibri-fuzz-") as tmp:
        geom, out = Path(tmp) / "g.json", Path(tmp) / "model"
        geom.write_text(json.dumps(geometry))
        try:
            small = synth.model_bytes(synth.validate_geometry(geometry)) <= 4 << 20
        except ColibriError:
            small = True  # refused: the CLI must say so in one line
        if not small:
            return  # valid but too big to write in a test; validate_geometry already ran on it
        code, _, err = cli("synth", "--geometry", geom, "-o", out, "--json", kind="geometry (synth, then run)")
        assert_clean_exit(code, err, "synth", "geometry (synth, then run)")
        if code == 0:
            assert run_and_check(out, kind="geometry (synth, then run)") == 0


TOML_VALUES = st.one_of(
    st.booleans(), st.sampled_from(SPECIAL_INTS[:-1]), st.integers(-10**6, 10**6), st.floats(allow_nan=True),
    st.text(max_size=8), st.sampled_from(["1GiB", "512M", "-1M", "9" * 400 + "G", "1e3", "nan", "lru", "mmap",
                                          "direct", "bf16", "auto", "0"]),
    st.lists(st.integers(0, 3), max_size=2))


@fuzz(100)
@given(settings_=st.dictionaries(st.sampled_from([*EngineConfig.field_names(), "prefetch_dept", "engine"]), TOML_VALUES, max_size=4),
       wrap=st.booleans(), junk=st.none() | st.sampled_from(["= =", "[engine", "a = " + "[" * 3000, "\x00", "\ud800"]))
def test_fuzz_engine_toml(base, settings_, wrap, junk):
    import tomli_w
    with tempfile.TemporaryDirectory(prefix="colibri-fuzz-") as tmp:
        path = Path(tmp) / "engine.toml"
        text = tomli_w.dumps({"engine": settings_} if wrap else settings_)
        path.write_text(text + (junk or ""), encoding="utf-8", errors="surrogatepass")
        code, out, err = cli("run", "--model", base["single"], *RUN_ARGS, "--json", "--config", path, kind="engine TOML")
        assert_clean_exit(code, err, "run", "engine TOML")


def walk_mutate(obj, path_picks: list[int], value, delete: bool):
    """Replace (or delete) one node of a JSON document, chosen by successive index picks."""
    node, parent, key = obj, None, None
    for pick in path_picks:
        if isinstance(node, dict) and node:
            parent, key = node, sorted(node)[pick % len(node)]
        elif isinstance(node, list) and node:
            parent, key = node, pick % len(node)
        else:
            break
        node = parent[key]
    if parent is None:
        return value
    if delete and isinstance(parent, dict):
        del parent[key]
    else:
        parent[key] = value
    return obj


def _profile_json() -> str:
    from test_probe_profile import make_profile
    return json.dumps(make_profile().to_dict())


def _routing_json() -> str:
    from engine.movement.cache import ROUTING_SCHEMA
    return json.dumps({"schema": ROUTING_SCHEMA, "counts": {"0:1": 3, "1:7": 2}})


def _load_profile(path):
    from tuner.probe.hardware_profile import load_profile
    return load_profile(path)


def _load_routing(path):
    from engine.movement.cache import routing_histogram_load
    return routing_histogram_load(path)


def _read_shared_profile(path):
    from tuner.share.profiles import read_profile_file
    return read_profile_file(path)


def _read_probe_for_import(path):
    from tuner.share.profiles import _read_probe_json
    return _read_probe_json(Path(path))


def _load_geometry(path):
    return synth.validate_geometry(synth.load_geometry_file(path))


# Every reader of a user-supplied JSON file: (name, a valid document, the reader). A new reader
# (profile import, a quant container's manifest, ...) is one more row here.
JSON_READERS = [
    ("profile", _profile_json, _load_profile),
    ("routing histogram", _routing_json, _load_routing),
    ("geometry", lambda: json.dumps(TINY), _load_geometry),
    ("shared profile (profile import/show/diff)", _profile_json, _read_shared_profile),
    ("probe JSON (profile import)", _profile_json, _read_probe_for_import),
]


@pytest.mark.parametrize("name,valid,reader", JSON_READERS, ids=[r[0] for r in JSON_READERS])
@fuzz(60)
@given(edits=st.lists(st.tuples(st.lists(st.integers(0, 50), min_size=1, max_size=5), VALUES, st.booleans()),
                      min_size=1, max_size=3),
       raw_cut=st.none() | st.floats(0, 1), nest=st.none() | st.integers(10, 5000))
def test_fuzz_json_readers(name, valid, reader, edits, raw_cut, nest):
    """Each reader returns a value or raises a ColibriError (one line): nothing else escapes."""
    doc = json.loads(valid())
    for picks, value, delete in edits:
        doc = walk_mutate(doc, picks, value, delete)
    text = dump_json(doc, raw_cut)
    if nest:
        text = "[" * nest + text + "]" * nest
    with tempfile.TemporaryDirectory(prefix="colibri-fuzz-") as tmp:
        path = Path(tmp) / "f.json"
        path.write_text(text)
        kind = f"{name} (reader)"
        try:
            with time_limit(LIMIT_S):
                reader(path)
        except ColibriError as exc:
            record(kind, "reader", "exit 2" if "\n" not in str(exc) else "bad error line")
            assert "\n" not in str(exc), str(exc)
        except BaseException as exc:
            record(kind, "reader", "hang" if isinstance(exc, ExampleHang) else "traceback")
            raise
        else:
            record(kind, "reader", "exit 0")


@fuzz(30, campaign_share=0.25)  # half a second an example (the tokenizers library builds the whole vocabulary)
@given(edits=st.lists(st.tuples(st.lists(st.integers(0, 400), min_size=1, max_size=4), VALUES, st.booleans()),
                      min_size=1, max_size=3), raw_cut=st.none() | st.floats(0, 1),
       prompt=st.sampled_from(["hello", "<|endoftext|>", "x" * 40, "\u00e9\u4e2d"]))
def test_fuzz_tokenizer_json(base, edits, raw_cut, prompt):
    """tokenizer.json is parsed by the tokenizers library; whatever it makes of a bad one, `run --prompt` stays clean."""
    with copy_of(base["single"]) as d:
        doc = json.loads((d / "tokenizer.json").read_text())
        for picks, value, delete in edits:
            doc = walk_mutate(doc, picks, value, delete)
        (d / "tokenizer.json").write_text(dump_json(doc, raw_cut))
        code, out, err = cli("run", "--model", d, "--prompt", prompt, "--max-new-tokens", "2", "--ctx-size", "64",
                             "--json", kind="tokenizer.json")
        assert_clean_exit(code, err, "run", "tokenizer.json")


# --- the same property through a real process ------------------------------------------------------

@fuzz(6, campaign_share=0.02)  # a process start is seconds: a few examples show the path works
@given(mutations=st.lists(config_mutation(), min_size=1, max_size=2),
       ops=st.lists(HEADER_OPS, max_size=2), raw_ops=st.lists(RAW_OPS, max_size=1))
def test_fuzz_through_the_cli_process(base, mutations, ops, raw_ops):
    with copy_of(base["single"]) as d:
        cfg = apply_config_mutations(json.loads((d / "config.json").read_text()), mutations)
        (d / "config.json").write_text(json.dumps(cfg))
        f = d / "model.safetensors"
        header, data = read_header(f)
        mutated = mutate_header(header, ops)
        apply_raw(f, mutated if isinstance(mutated, str) else json.dumps(mutated), data, raw_ops)
        proc = subprocess.run([sys.executable, "-m", "colibri.cli", "run", "--model", str(d), *RUN_ARGS, "--json"],
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                              timeout=300)
        assert_clean_exit(proc.returncode, proc.stderr, "run", "config.json + header (a real process)")
