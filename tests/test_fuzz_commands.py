"""Every command that reads a user file or path, driven through the CLI with hostile inputs
(issue 23, item 7): special paths, mutated files of every kind, output paths that are victims,
tune's refusal paths, and fuzzed flag values.

Each batch of command lines runs in one child process under an address-space limit with a
per-call alarm (tests/colibri_fuzz.py), so a reader that grows without bound or blocks fails the
test instead of the machine. The property: exit 0, or exit 2 with one `colibri <cmd>: error:`
line naming the input; no traceback; wall time and peak RSS bounded; victims intact.

CI runs a bounded, derandomized set; `make fuzz` (COLIBRI_FUZZ_EXAMPLES) runs more, randomly.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from colibri_fuzz import Call, Victims, assert_batch, record, special_paths
from colibri_readonly import make_read_only, undo_read_only
from colibri_tiny import RUN_ARGS, TINY, make_tiny
from engine.base.config import EngineConfig
from report_fixture import make_run
from test_fuzz import VALUES, dump_json, walk_mutate
from tests.test_probe_profile import make_profile
from colibri.cli import build_parser
from tuner.probe.hardware_profile import save_profile
from tuner.share.profiles import export_profile, write_profile_file

CAMPAIGN = int(os.environ.get("COLIBRI_FUZZ_EXAMPLES", "0"))


def batches(ci_examples: int, campaign_share: float = 0.01):
    """A batch is a child process (seconds): CI runs a few, derandomized, and does not shrink (a
    shrink reruns whole batches; the failure message already lists every failing call)."""
    examples = max(ci_examples, int(CAMPAIGN * campaign_share)) if CAMPAIGN else ci_examples
    return settings(max_examples=examples, deadline=None, derandomize=not CAMPAIGN, database=None,
                    phases=[Phase.explicit, Phase.generate] + ([Phase.shrink] if CAMPAIGN else []),
                    suppress_health_check=list(HealthCheck))


# --- the world: one of every input a user brings ------------------------------------------------

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzzworld")
    w = {"root": root, "model": make_tiny(root / "model"), "run": make_run(root / "run")}
    save_profile(make_profile(), root / "probe.json")
    w["probe"] = root / "probe.json"
    w["shared"] = root / "shared.json"
    write_profile_file(export_profile(w["run"]), w["shared"])
    w["geometry"] = root / "geometry.json"
    w["geometry"].write_text(json.dumps({**TINY, "max_shard_size": 1 << 30}))
    w["toml"] = root / "engine.toml"
    EngineConfig(ctx_size=64).save(w["toml"])
    w["text"] = root / "text.txt"
    w["text"].write_text("def f(x):\n    return x + 1\n" * 40)
    w["special"] = special_paths(root / "special")
    big = root / "special" / "big-string.json"  # 24 MB in one JSON string: the nesting guard's worst case
    big.write_text(json.dumps({"description": "x" * (24 << 20)}))
    w["special"]["json_big_string"] = big
    return w


def batch_env(w) -> dict:
    return {"XDG_CONFIG_HOME": str(w["root"] / "xdg")}  # the profile store: `profile import` writes there


class Outs:
    """Fresh output paths and working directories under one root, numbered."""

    def __init__(self, root: Path):
        self.root, self.n = root, 0

    def path(self, stem: str = "out") -> str:
        self.n += 1
        return str(self.root / f"{stem}-{self.n}")

    def cwd(self) -> str:
        d = Path(self.path("cwd"))
        d.mkdir(parents=True)
        return str(d)


def reader_calls(w, p: Path, outs: Outs, kind: str = "") -> list[Call]:
    """Every command line that reads a user path, with `p` in that place."""
    m, probe, shared, run = str(w["model"]), str(w["probe"]), str(w["shared"]), str(w["run"])
    ps = str(p)
    small_quality = ["--tokens", "32", "--ctx", "16", "--json"]
    lines = [
        ["run", "--model", ps, *RUN_ARGS, "--json"],
        ["run", "--model", m, *RUN_ARGS, "--json", "--config", ps],
        ["run", "--model", m, *RUN_ARGS, "--json", "--ram-budget", "8GiB", "--cache-policy", "pinned",
         "--routing-histogram", ps],
        ["bench", "--model", ps, "--tokens", "1", "--repeats", "1", "--prompt-tokens", "2", "--ctx-size", "16",
         "--json"],
        ["convert", ps, "-o", outs.path(), "--json"],
        ["quality", "--model", ps, "--reference", m, *small_quality],
        ["quality", "--model", m, "--reference", ps, *small_quality],
        ["quality", "--model", m, "--reference", m, "--text", ps, *small_quality],
        ["synth", "--geometry", ps, "-o", outs.path(), "--json"],
        ["plan", "--model", ps, "--profile", probe, "--json"],
        ["plan", "--model", m, "--profile", ps, "--json"],
        ["plan", "--model", m, "--profile", probe, "--config", ps, "--json"],
        ["plan", "--model", m, "--profile", probe, "--routing", ps, "--json"],
        ["tune", "--model", m, "--profile", ps, "--trials", "1", "--out", outs.path(), "--json"],
        ["profile", "import", ps, "--json"],
        ["profile", "show", ps, "--json"],
        ["profile", "diff", ps, shared, "--json"],
        ["profile", "export", ps, "--json"],
        ["report", ps, "--json"],
        ["compare", ps, run, "--out", outs.path(), "--json"],
    ]
    names = (ps, p.name)
    return [Call(argv, names=names, cwd=outs.cwd(), kind=f"special path: {kind}") for argv in lines]


SPECIAL_KINDS = ["fifo", "dev_zero", "directory", "symlink_loop", "missing", "empty", "binary", "huge_sparse",
                 "json_big_string"]


@pytest.mark.parametrize("kind", SPECIAL_KINDS)
def test_special_paths_in_every_reader(world, kind, tmp_path):
    """A FIFO, /dev/zero, a directory, a symlink loop, ... in every place a command reads a path:
    refused in one line naming it (or, where it is a valid input, accepted), promptly, in bounded
    memory. A FIFO must not block; /dev/zero and a 2 GB file must not be read whole."""
    p = world["special"][kind]
    victims = Victims().add(world["model"], world["run"], world["probe"], world["shared"])
    assert_batch(reader_calls(world, p, Outs(tmp_path), kind), victims, call_s=10, env=batch_env(world))


# --- mutated files of every kind --------------------------------------------------------------------

EDITS = st.lists(st.tuples(st.lists(st.integers(0, 60), min_size=1, max_size=5), VALUES, st.booleans()),
                 min_size=1, max_size=3)
JSON_MUTATION = st.tuples(EDITS, st.none() | st.floats(0, 1), st.none() | st.integers(10, 3000))


def mutate_json(doc, mutation) -> str:
    edits, raw_cut, nest = mutation
    doc = json.loads(json.dumps(doc))
    for picks, value, delete in edits:
        doc = walk_mutate(doc, picks, value, delete)
    text = dump_json(doc, raw_cut)
    return "[" * nest + text + "]" * nest if nest else text


TEXT_MUTATION = st.one_of(
    st.binary(max_size=300).map(lambda b: ("bytes", b)),
    st.text(max_size=200).map(lambda t: ("text", t)),
    st.tuples(st.floats(0, 1), st.integers(0, 255)).map(lambda f: ("flip", f)),
    st.integers(1, 64).map(lambda n: ("long_line", n)),
)


def mutate_text(original: bytes, mutation) -> bytes:
    op, arg = mutation
    if op == "bytes":
        return original[: len(original) // 2] + arg
    if op == "text":
        return original + arg.encode("utf-8", "surrogatepass")
    if op == "flip":
        buf = bytearray(original)
        if buf:
            buf[min(len(buf) - 1, int(len(buf) * arg[0]))] = arg[1]
        return bytes(buf)
    return original + b"a," * (arg << 14)  # one line of up to 2 MB


CSV_MUTATION = st.one_of(
    TEXT_MUTATION.map(lambda m: ("text", m)),
    st.tuples(st.integers(0, 40), st.integers(0, 40), VALUES).map(lambda t: ("cell", t)),
    st.integers(0, 40).map(lambda i: ("drop_column", i)),
)


def mutate_csv(original: str, mutation) -> bytes:
    op, arg = mutation
    if op == "text":
        return mutate_text(original.encode(), arg)
    rows = list(csv.reader(io.StringIO(original)))
    if op == "cell" and len(rows) > 1:
        r, c, value = arg
        row = rows[1 + r % (len(rows) - 1)]
        if row:
            row[c % len(row)] = json.dumps(value) if not isinstance(value, str) else value
    elif op == "drop_column" and rows and rows[0]:
        c = arg % len(rows[0])
        rows = [row[:c] + row[c + 1:] for row in rows]
    out = io.StringIO()
    csv.writer(out).writerows(rows)
    return out.getvalue().encode("utf-8", "surrogatepass")


KINDS = ["geometry", "probe_profile", "shared_profile", "toml", "result_json", "trials_csv", "text"]
CASE = st.one_of(
    st.tuples(st.sampled_from(["geometry", "probe_profile", "shared_profile", "result_json"]), JSON_MUTATION),
    st.tuples(st.just("toml"), TEXT_MUTATION),
    st.tuples(st.just("trials_csv"), CSV_MUTATION),
    st.tuples(st.just("text"), TEXT_MUTATION),
)


def build_case(w, kind: str, mutation, where: Path, outs: Outs) -> list[Call]:
    """Write one mutated input under `where`; return the command lines that read it."""
    m, probe, shared, run = str(w["model"]), str(w["probe"]), str(w["shared"]), str(w["run"])
    where.mkdir(parents=True)
    if kind in ("result_json", "trials_csv"):
        rd = where / "run"
        shutil.copytree(w["run"], rd)
        name = "result.json" if kind == "result_json" else "trials.csv"
        f = rd / name
        f.write_bytes(mutate_json(json.loads(f.read_text()), mutation).encode("utf-8", "surrogatepass")
                      if kind == "result_json" else mutate_csv(f.read_text(), mutation))
        names = (str(rd), rd.name, name)
        lines = [["report", str(rd), "--json"], ["compare", str(rd), run, "--out", outs.path(), "--json"],
                 ["profile", "export", str(rd), "--json"]]
        return [Call(a, names=names, cwd=outs.cwd(), note=f"mutated {name}", kind=f"mutated {name}") for a in lines]
    source = {"geometry": w["geometry"], "probe_profile": w["probe"], "shared_profile": w["shared"],
              "toml": w["toml"], "text": w["text"]}[kind]
    f = where / source.name
    if kind in ("toml", "text"):
        f.write_bytes(mutate_text(source.read_bytes(), mutation))
    else:
        f.write_bytes(mutate_json(json.loads(source.read_text()), mutation).encode("utf-8", "surrogatepass"))
    fs = str(f)
    lines = {
        "geometry": [["synth", "--geometry", fs, "-o", outs.path(), "--json"],
                     ["plan", "--model", fs, "--profile", probe, "--json"]],
        "probe_profile": [["plan", "--model", m, "--profile", fs, "--json"],
                          ["profile", "export", fs, "--json"], ["profile", "import", fs, "--json"]],
        "shared_profile": [["profile", "import", fs, "--json"], ["profile", "show", fs, "--json"],
                           ["profile", "diff", fs, shared, "--json"],
                           ["compare", fs, shared, "--out", outs.path(), "--json", "--force"]],
        "toml": [["run", "--model", m, *RUN_ARGS, "--json", "--config", fs],
                 ["plan", "--model", m, "--profile", probe, "--config", fs, "--json"]],
        "text": [["quality", "--model", m, "--reference", m, "--text", fs, "--tokens", "32", "--ctx", "16",
                  "--json"]],
    }[kind]
    return [Call(a, names=(fs, f.name), cwd=outs.cwd(), note=f"mutated {kind}", kind=f"mutated {kind}") for a in lines]


@batches(4, campaign_share=0.025)
@given(cases=st.lists(CASE, min_size=7, max_size=7))
def test_fuzz_user_files_through_the_cli(world, tmp_path_factory, cases):
    """Mutated geometry, probe and shared profiles, engine TOML, result.json, trials.csv and text,
    each through every command that reads it, in one child process per example."""
    root = tmp_path_factory.mktemp("cases")
    outs = Outs(root / "outs")
    calls = []
    for i, (kind, mutation) in enumerate(cases):
        calls += build_case(world, kind, mutation, root / f"case-{i}", outs)
    victims = Victims().add(world["model"], world["run"], world["probe"], world["shared"])
    assert_batch(calls, victims, call_s=30, env=batch_env(world))


# --- outputs: never destroy what we did not write ---------------------------------------------------

def test_output_paths_never_destroy_a_victim(world, tmp_path):
    """Each writing command aimed at a path that is not its own previous output: the source, inside
    or above the source, the working directory, '', a non-empty foreign directory, a file, a symlink
    to the source, a FIFO, a read-only directory (immutable when run as root). It refuses in one
    line (or writes elsewhere); every sentinel and the source survive. ('/' is not tried: a bug
    there would wipe the machine.)"""
    v = Victims()
    top = tmp_path / "top"
    parent = top / "parent"
    src = parent / "src"
    shutil.copytree(world["model"], src)
    v.sentinel(top)
    v.sentinel(parent)
    run = tmp_path / "run"
    shutil.copytree(world["run"], run)
    v.add(src, run)
    foreign = tmp_path / "foreign"
    v.sentinel(foreign)
    a_file = tmp_path / "a-file"
    a_file.write_text("not yours\n")
    v.add(a_file)
    link = tmp_path / "link-to-src"
    os.symlink(src, link)
    fifo = world["special"]["fifo"]
    cwd = tmp_path / "cwd"
    v.sentinel(cwd)
    c = str(cwd)
    s = str(src)
    calls = []
    for dst in (s, f"{s}/q", str(parent), str(top), ".", "", str(foreign), str(a_file), str(link)):
        calls.append(Call(["convert", s, "-o", dst, "--force", "--json"], cwd=c, note=f"convert -o {dst!r}"))
    # Not `synth -o SRC --force`: SRC is itself a synth output, which --force may replace by design.
    for dst in (".", "", str(foreign), str(a_file)):
        calls.append(Call(["synth", "tiny", "-o", dst, "--force", "--json"], cwd=c, note=f"synth -o {dst!r}"))
    for dst in (str(a_file), str(foreign), str(run), s):
        calls.append(Call(["compare", str(run), str(world["run"]), "--out", dst, "--force", "--json"], cwd=c,
                          note=f"compare --out {dst!r}"))
    for dst in (str(a_file), str(foreign), str(fifo), str(run / "result.json"), "/proc/colibri-x"):
        calls.append(Call(["profile", "export", str(run), "-o", dst, "--json"], cwd=c, note=f"export -o {dst!r}"))
    for dst in (str(foreign), str(fifo), "/proc/colibri-x", str(tmp_path / "no" / "dir" / "p.json")):
        calls.append(Call(["probe", "--quick", "--no-fio", "--dir", str(tmp_path), "-o", dst, "--json"], cwd=c,
                          note=f"probe -o {dst!r}"))
    for dst in (str(a_file), str(src / "config.json"), str(fifo)):  # not a routing histogram: refused (issue 37)
        calls.append(Call(["run", "--model", s, *RUN_ARGS, "--record-routing", dst], cwd=c,
                          note=f"--record-routing {dst!r}"))
    # A directory nobody may write in (root included: chattr +i): every writer refuses up front.
    ro = tmp_path / "read-only"
    ro.mkdir()
    why_not = make_read_only(ro)
    if why_not is None:
        r = str(ro)
        calls += [Call(["convert", s, "-o", f"{r}/q", "--json"], cwd=c, names=(r,), note="convert into a read-only dir"),
                  Call(["synth", "tiny", "-o", f"{r}/m", "--json"], cwd=c, names=(r,), note="synth into a read-only dir"),
                  Call(["compare", str(run), str(world["run"]), "--out", f"{r}/c.md", "--json"], cwd=c, names=(r,),
                       note="compare into a read-only dir"),
                  Call(["profile", "export", str(run), "-o", f"{r}/p.json", "--json"], cwd=c, names=(r,),
                       note="export into a read-only dir"),
                  Call(["probe", "--quick", "--no-fio", "--dir", str(tmp_path), "-o", f"{r}/p.json", "--json"],
                       cwd=c, names=(r,), note="probe -o into a read-only dir")]
    for call in calls:
        call.kind = "output path"
    try:
        assert_batch(calls, v, call_s=30, env=batch_env(world))
        if why_not is None:
            assert os.listdir(ro) == [], "a writer left something in the read-only directory"
    finally:
        if why_not is None:
            undo_read_only(ro)


def test_refused_tune_leaves_nothing_behind(world, tmp_path):
    """A tune refused for a bad --profile, --from-profile, --quant level or storage URL: one line,
    and its --out directory does not exist afterwards (no run.json, no study.db)."""
    m, special = str(world["model"]), world["special"]
    bad_profile = tmp_path / "bad-profile.json"
    bad_profile.write_text(json.dumps({"schema": "colibri.profile/999"}))
    outs = Outs(tmp_path)
    cases = [
        (["--profile", str(bad_profile)], "bad-profile.json"),
        (["--profile", str(special["fifo"])], "fifo-input"),
        (["--profile", str(special["dev_zero"])], "zero"),
        (["--profile", str(world["probe"]), "--from-profile", str(bad_profile)], "bad-profile.json"),
        (["--profile", str(world["probe"]), "--quant", "int9"], "int9"),
        (["--profile", str(world["probe"]), "--storage", "nosuchdb://x"], "nosuchdb"),
        (["--profile", str(world["probe"]), "--quant", "int8", "--quality-text", str(special["dev_zero"])], "zero"),
    ]
    calls, outs_of = [], []
    for extra, name in cases:
        out = outs.path("tune")
        outs_of.append(out)
        calls.append(Call(["tune", "--model", m, "--trials", "1", "--out", out, *extra, "--json"], names=(name,),
                          cwd=outs.cwd(), note="refused tune", kind="refused tune"))
    assert_batch(calls, Victims().add(world["model"], world["probe"]), call_s=30, env=batch_env(world))
    left = [o for o in outs_of if Path(o).exists()]
    assert not left, f"refused tunes left run directories behind: {left}"


# --- writer flags: every declared output option aimed at a victim, spelt many ways ------------------

@pytest.fixture(scope="module")
def writer_world(tmp_path_factory):
    """tests/test_writer_guard.py's world (sources of every kind, a user's files and directories, a
    FIFO, a socket, a device), with every writer's targets made (their symlinks) before hashing."""
    from test_writer_guard import WRITERS, build_world, targets
    w = build_world(tmp_path_factory.mktemp("ww"))
    w["targets"] = [targets(w, writer) for writer in WRITERS]
    w["links"] = tmp_path_factory.mktemp("links")  # outside the hashed world
    return w


# Ways to spell the same victim; "inside" names a fresh path under a victim where that is refused
# too (under the source, or under a file). None of them may ever name a fresh path elsewhere: '' and
# '/' are only spelt as themselves or as '/' again, so no case can write at the filesystem's root.
SPELLINGS = ["as is", "trailing slash", "dot", "double slash", "dotdot", "relative", "symlink", "inside"]
NAME_TEXT = st.text(st.characters(blacklist_characters="/\0", blacklist_categories=("Cs",)), min_size=1,
                    max_size=24).filter(lambda t: t not in (".", ".."))


def spell(w, victim: str, path: str, how: str, name: str, cwd: str) -> str | None:
    """`path` spelt `how`; None where that spelling would name something other than a victim."""
    if path in ("", "/") or victim == "proc":
        return path
    if how == "trailing slash":
        return path + "/"
    if how == "dot":
        return path + "/."
    if how == "double slash":
        return path.replace("/", "//")
    if how == "dotdot":
        return f"{path}/../{Path(path).name}" if path != "." else "../" + Path(cwd).name
    if how == "relative":  # relative to the call's working directory, not this process's
        return os.path.relpath(Path(cwd, path), cwd)
    if how == "symlink":
        link = w["links"] / f"l{len(os.listdir(w['links']))}"
        link.symlink_to(Path(cwd, path).resolve() if path == "." else path)
        return str(link)
    if how == "inside":  # refused as inside the source, or as under something that is not a directory
        if "source" in victim or (os.path.lexists(path) and not os.path.isdir(path)):
            return f"{path}/{name}"
        return None  # under '.', a user's directory or the source's parent: a fresh path, a valid output
    return path


WRITER_CASE = st.tuples(st.integers(0, 10_000), st.integers(0, 10_000), st.sampled_from(SPELLINGS), NAME_TEXT,
                        st.booleans())


@batches(3, campaign_share=0.05)
@given(cases=st.lists(WRITER_CASE, min_size=12, max_size=12))
def test_fuzz_writer_flags(writer_world, cases):
    """Random victims (the source, inside or above it, '.', '/', '', a user's directory or file, a
    FIFO, a socket, a device, /proc) spelt random ways, for random declared writer options with or
    without --force, each call in the fork server under its memory and time limits: exit 2 with one
    error line, and the whole world unchanged."""
    from test_writer_guard import WRITERS
    w = writer_world
    cwd = str(w["root"] / "cwd")
    calls = []
    for pick, victim_pick, how, name, force in cases:
        writer = WRITERS[pick % len(WRITERS)]
        victims = w["targets"][pick % len(WRITERS)]
        victim = sorted(victims)[victim_pick % len(victims)]
        target = spell(w, victim, victims[victim], how, name, cwd) or victims[victim]
        argv = [*writer.argv(w, target), *(["--force"] if force and writer.force else [])]
        calls.append(Call(argv, cwd=cwd, note=f"{writer.id()}: {victim} spelt {how}", kind="writer flag"))
    results = assert_batch(calls, Victims().add(w["root"]), call_s=30, env={"XDG_CONFIG_HOME": str(w["links"])})
    accepted = [r.call.label() for r in results if r.code != 2]
    assert not accepted, "a writer accepted a victim:\n" + "\n".join(accepted)


# --- flag values ------------------------------------------------------------------------------------

def _numeric_flags():
    """(argv prefix, flag, dest, type) for every flag with a ranged type (colibri/commands/argtypes.py)."""
    from test_argtypes import subparsers
    prefixes = {"colibri run": ["run", "--model", "m"], "colibri bench": ["bench", "--model", "m"],
                "colibri convert": ["convert", "s", "-o", "d"],
                "colibri quality": ["quality", "--model", "a", "--reference", "b"],
                "colibri synth": ["synth", "tiny", "-o", "x"], "colibri tune": ["tune"],
                "colibri plan": ["plan", "--model", "m", "--profile", "p"]}
    return [(prefixes[prog], action.option_strings[-1], action.dest, action.type)
            for prog, sub in subparsers(build_parser()).items() if prog in prefixes
            for action in sub._actions if hasattr(action.type, "range_text")]


NUMERIC_FLAGS = _numeric_flags()
FLAG_VALUES = st.one_of(
    st.integers(-2**80, 2**80).map(str), st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "-nan", "inf", "-inf", "1e400", "-0", "0", "0x10", "1_000", " 5", "5 ", "", "-", "--",
                     "1GiB", "-1GiB", "1e3", "2**70", "9" * 5000, "1h30m", "-10m", "0.0", "1e-320", "\u0661"]),
    st.text(max_size=8))


@settings(max_examples=300 if not CAMPAIGN else CAMPAIGN, deadline=None, derandomize=not CAMPAIGN, database=None)
@given(pick=st.integers(0, len(NUMERIC_FLAGS) - 1), value=FLAG_VALUES, joined=st.booleans())
def test_fuzz_numeric_flag_values(pick, value, joined):
    """Any text after any numeric flag parses to a finite value within the flag's bounds, or is
    one `colibri <cmd>: error:` line and exit 2 (in-process: parsing only, nothing runs)."""
    prefix, flag, dest, parse = NUMERIC_FLAGS[pick]
    argv = [*prefix, f"{flag}={value}"] if joined else [*prefix, flag, value]
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            parsed = getattr(build_parser().parse_args(argv), dest)
        except SystemExit as exc:
            lines = err.getvalue().splitlines()
            clean = exc.code == 2 and len(lines) == 1 and ": error: " in lines[0]
            record("flag value", prefix[0], "exit 2" if clean else "bad error line")
            assert clean, (argv, err.getvalue())
            return
        except BaseException:
            record("flag value", prefix[0], "traceback")
            raise
    record("flag value", prefix[0], "exit 0")
    # A list flag (argtypes.int_list, e.g. plan --batch 1,2,4) gives a non-empty tuple of such values.
    values = parsed if isinstance(parsed, tuple) and parsed else (parsed,)
    for v in values:
        assert isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), (argv, parsed)
        assert (parse.lo is None or v >= parse.lo) and (parse.hi is None or v <= parse.hi), (argv, parsed)
