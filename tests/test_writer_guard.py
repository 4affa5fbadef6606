"""Every option that names something a command writes goes through the output guard (issue 37).

Two halves:
- the enumeration: the CLI's own parsers are walked; an option whose help or metavar says it
  writes (or names a file or directory) must be declared with argtypes.add_output_option (which
  records the engine/base/output_target.py rule it goes through) or be listed in READERS with
  why it is not a writer. A new writer added with a plain add_argument fails here.
- the destructive cases: every declared writer (WRITERS must cover each one) aimed at '', '.',
  '/', its source, a file in it, a fresh path inside it, a directory above it, a symlink to it,
  a user's non-empty directory, a user's file, the model's config.json, a FIFO, a socket, a
  device and /proc: exit 2 with one `colibri <cmd>: error:` line and no traceback, with and
  without --force, the work itself never started, and the whole world (every file's bytes and
  every special file's kind) unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import re
import shutil
import socket
import stat
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from colibri_tiny import RUN_ARGS, make_tiny
from report_fixture import make_run
from tests.test_probe_profile import make_profile
from colibri import cli
from colibri.commands.argtypes import ColibriArgumentParser, add_output_option
from tuner.probe.hardware_profile import save_profile
from tuner.share.profiles import export_profile, write_profile_file

# --- the enumeration ---------------------------------------------------------------------------------

SAYS_IT_WRITES = re.compile(r"\b(write|writes|written|writing|output|outputs|save|saves|saved|store|stores|"
                            r"stored|dump|dumps|record|records)\b", re.IGNORECASE)
NAMES_A_PATH = re.compile(r"\b(DIR|DST|OUT|FILE)\b|_DIR\b")

# Options the heuristic flags that only read: (prog, option) -> why.
READERS = {
    ("colibri run", "--routing-histogram"): "reads a histogram --record-routing wrote",
    ("colibri bench", "--routing-histogram"): "reads a histogram",
    ("colibri serve", "--routing-histogram"): "reads a histogram",
    ("colibri chat", "--routing-histogram"): "reads a histogram",
    ("colibri bench", "--prompts"): "reads prompts",
    ("colibri bench", "--workload"): "reads a saved workload",
    ("colibri bench", "--trace"): "reads a request trace",
    ("colibri tune", "--trace"): "reads a request trace (tune saves its tokens inside its --out)",
    ("colibri tune", "--prompts"): "reads prompts (tune saves their tokens inside its --out)",
    ("colibri tune", "--from-profile"): "reads a profile",
    ("colibri tune", "--profile"): "reads a saved probe",
    ("colibri tune", "--quant"): "a list of levels ('as stored' is about the source)",
    ("colibri tune", "--quality-text"): "reads a text corpus",
    ("colibri synth", "--geometry"): "reads a geometry file",
    ("colibri plan", "--calibrate"): "reads run directories (the factors go to --profile, a declared writer)",
    ("colibri plan", "--test"): "reads a run directory",
    ("colibri profile export", "source"): "reads a run or a probe",
    ("colibri profile import", "file"): "reads a profile (the store's copy is --name's, declared)",
    ("colibri profile show", "ref"): "reads a profile",
    ("colibri compare", "inputs"): "reads runs and profiles",
    ("colibri doctor", "--profile"): "reads a saved probe",
}


def option_name(action: argparse.Action) -> str:
    return action.option_strings[-1] if action.option_strings else action.dest


def walk(parser: argparse.ArgumentParser, prog: str = "colibri"):
    """(prog, action) for every option and positional that takes a value, in every subparser."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from walk(sub, f"{prog} {name}")
        elif action.nargs != 0 and not isinstance(action, argparse._HelpAction):
            yield prog, action


def looks_like_a_writer(action: argparse.Action) -> bool:
    help_text = "" if action.help == argparse.SUPPRESS else (action.help or "")
    return bool(SAYS_IT_WRITES.search(help_text) or NAMES_A_PATH.search(str(action.metavar or "")))


def undeclared_writers(parser) -> list[str]:
    """Options that look like writers, are not declared with add_output_option, nor in READERS."""
    return [f"{prog} {option_name(a)}" for prog, a in walk(parser)
            if looks_like_a_writer(a) and not getattr(a, "output_kind", None)
            and (prog, option_name(a)) not in READERS]


def declared_writers(parser) -> dict[tuple[str, str], str]:
    return {(prog, option_name(a)): a.output_kind for prog, a in walk(parser) if getattr(a, "output_kind", None)}


def test_every_writer_option_is_declared_with_the_guard():
    parser = cli.build_parser()
    assert undeclared_writers(parser) == [], "writer options not declared with add_output_option"
    everything = {(prog, option_name(a)) for prog, a in walk(parser)}
    assert set(READERS) <= everything, f"stale READERS entries: {set(READERS) - everything}"
    assert not set(READERS) & set(declared_writers(parser)), "an option is both a reader and a writer"
    assert set(declared_writers(parser)) == {w.key for w in WRITERS}, \
        "every declared writer needs its destructive cases in WRITERS (and nothing else is there)"


def test_a_new_writer_that_skips_the_guard_is_caught():
    """The enumeration's teeth: a writer added with a plain add_argument is reported; declared, it is not."""
    parser = ColibriArgumentParser(prog="colibri")
    sub = parser.add_subparsers(dest="command").add_parser("dump")
    sub.add_argument("--dump-to", metavar="FILE", help="write the state here")
    assert undeclared_writers(parser) == ["colibri dump --dump-to"]
    add_output_option(sub, "--log", kind="file", metavar="FILE", help="write a log")
    assert declared_writers(parser) == {("colibri dump", "--log"): "file"}
    with pytest.raises(ValueError, match="unknown output kind"):
        add_output_option(sub, "--x", kind="anything")


def test_outcome_is_hidden_from_help(capsys):
    """--outcome is the tuner's own (its trial process writes there): not offered to users."""
    with contextlib.suppress(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "--read-trace" in out and "--outcome" not in out


# --- the world the destructive cases aim at -----------------------------------------------------------

def make_socket(path: Path) -> bool:
    if len(os.fsencode(path)) >= 100:  # sun_path's limit
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(path))
    finally:
        s.close()  # the socket file stays: a socket inode nothing listens on
    return True


def make_device(path: Path) -> str | None:
    """A character device to aim at. As root: our own node (1:3, like /dev/null), so a writer that
    replaced it would only replace ours; unprivileged: /dev/full, which no one but root can replace.
    None where neither is safe (root without mknod)."""
    if os.geteuid() != 0:
        return "/dev/full"
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except OSError:
        return None
    return str(path)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("w"))


def build_world(root: Path) -> dict:
    """Sources of every kind (a model, a GGUF, a run, profiles, a geometry file), a user's
    directories and files, a FIFO, a socket and a device, all under root (hashed whole)."""
    from gguf_export import export
    w = {"root": root, "model": make_tiny(root / "model"), "run": make_run(root / "run")}
    save_profile(make_profile(), root / "probe.json")
    w["probe"] = root / "probe.json"
    w["shared"] = root / "shared.json"
    write_profile_file(export_profile(w["run"]), w["shared"])
    (root / "gsrc").mkdir()
    w["gguf"] = export(w["model"], root / "gsrc" / "m.gguf")
    (root / "gsrc" / "notes.txt").write_text("a user's file beside the GGUF\n")
    (root / "geo").mkdir()
    w["geometry"] = root / "geo" / "geometry.json"
    w["geometry"].write_text((w["model"] / "config.json").read_text())
    (root / "geo" / "SENTINEL").write_text("beside the geometry\n")
    for d in ("user", "cwd", "scratch"):
        (root / d).mkdir()
        (root / d / "SENTINEL").write_text(f"the user's {d}\n")
    w["notes"] = root / "notes.json"
    w["notes"].write_text('{"mine": true}\n')
    os.mkfifo(root / "fifo")
    w["socket"] = root / "sk" if make_socket(root / "sk") else None
    w["device"] = make_device(root / "chardev")
    return w


def world_digest(root: Path) -> str:
    """Every name under root, its kind, and a regular file's bytes (a FIFO is never opened)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        st = os.lstat(p)
        h.update(os.fsencode(p.relative_to(root)) + oct(stat.S_IFMT(st.st_mode)).encode())
        if stat.S_ISREG(st.st_mode):
            h.update(p.read_bytes())
        elif stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(p).encode())
        elif stat.S_ISCHR(st.st_mode):
            h.update(str(st.st_rdev).encode())
    return h.hexdigest()


@dataclass
class Writer:
    key: tuple[str, str]  # (prog, option) as the enumeration names it
    argv: object  # (world, target) -> argv
    source: str | None = None  # the world's key of the command's source
    force: bool = False  # the command has --force: every case runs with it too
    work: tuple[str, ...] = ()  # "module:attr" that must not run when the output is refused
    skip: frozenset = field(default_factory=frozenset)  # targets that are valid inputs for this writer
    label: str = ""

    def id(self) -> str:
        return self.label or f"{self.key[0][8:]} {self.key[1]}"


def bench(flag):
    return lambda w, t: ["bench", "--model", str(w["model"]), "--tokens", "1", "--repeats", "1", "--prompt-tokens",
                         "2", "--ctx-size", "16", "--json", flag, t]


BENCH_WORK = ("colibri.commands.run:bench", "colibri.commands.run:run_trial")
DIRECTORIES = frozenset({"", "cwd", "root", "source", "symlink to source", "parent", "user dir", "inside source"})
WRITERS = [
    Writer(("colibri run", "--record-routing"), lambda w, t: ["run", "--model", str(w["model"]), *RUN_ARGS, "--json",
                                                               "--record-routing", t],
           source="model", work=("colibri.commands.run:run",)),
    Writer(("colibri run", "--prompt-cache"), lambda w, t: ["run", "--model", str(w["model"]), *RUN_ARGS, "--json",
                                                             "--prompt-cache", t],
           source="model", work=("colibri.commands.run:run",)),
    Writer(("colibri serve", "--kv-dir"), lambda w, t: ["serve", "--model", str(w["model"]), "--kv-dir", t],
           source="model", work=("colibri.commands.serve:serve", "colibri.commands.serve:resolve_model")),
    Writer(("colibri chat", "--kv-dir"), lambda w, t: ["chat", "--model", str(w["model"]), "--kv-dir", t],
           source="model", work=("colibri.commands.serve:LoadedModel", "colibri.commands.serve:resolve_model")),
    Writer(("colibri bench", "--record-routing"), bench("--record-routing"), source="model", work=BENCH_WORK),
    Writer(("colibri bench", "--read-trace"), bench("--read-trace"), source="model", work=BENCH_WORK),
    Writer(("colibri bench", "--outcome"), bench("--outcome"), source="model", work=BENCH_WORK),
    Writer(("colibri probe", "--output"), lambda w, t: ["probe", "--quick", "--no-fio", "--dir",
                                                         str(w["root"] / "scratch"), "-o", t],
           work=("colibri.commands.machine:run_probe",)),
    # --dir is a scratch directory (a new O_EXCL test file, removed): any directory is a valid one.
    Writer(("colibri probe", "--dir"), lambda w, t: ["probe", "--quick", "--no-fio", "--dir", t], skip=DIRECTORIES),
    Writer(("colibri plan", "--profile"), lambda w, t: ["plan", "--model", str(w["model"]), "--profile", t,
                                                         "--calibrate", str(w["run"]), "--json"],
           work=("colibri.commands.machine:run_plan",)),
    Writer(("colibri tune", "--out"), lambda w, t: ["tune", "--model", str(w["model"]), "--profile", str(w["probe"]),
                                                     "--trials", "1", "--out", t, "--json"],
           source="model", work=("tuner.search.setup:TuneSession.start",)),
    Writer(("colibri synth", "--out"), lambda w, t: ["synth", "--geometry", str(w["geometry"]), "-o", t, "--json"],
           source="geometry", force=True),
    Writer(("colibri report", "run_dir"), lambda w, t: ["report", t, "--json"], source="run",
           skip=frozenset({"source", "symlink to source"})),  # its own run is what it writes into
    Writer(("colibri profile export", "--output"), lambda w, t: ["profile", "export", str(w["run"]), "-o", t],
           source="run"),
    Writer(("colibri profile import", "--name"), lambda w, t: ["profile", "import", str(w["shared"]), "--name", t,
                                                                "--json"], source="shared", force=True),
    Writer(("colibri compare", "--out"), lambda w, t: ["compare", str(w["run"]), str(w["shared"]), "--out", t,
                                                        "--json"], source="run", force=True),
    Writer(("colibri convert", "--out"), lambda w, t: ["convert", str(w["model"]), "-o", t, "--quant", "int8",
                                                        "--json"],
           source="model", force=True, work=("engine.format.convert:Converter",), label="convert -o (model dir)"),
    Writer(("colibri convert", "--out"), lambda w, t: ["convert", str(w["gguf"]), "-o", t, "--json"],
           source="gguf", force=True, work=("engine.format.gguf.importer:GGUFModel",), label="convert -o (GGUF)"),
]


def targets(w, writer: Writer) -> dict[str, str]:
    root = w["root"]
    t = {"": "", "cwd": ".", "root": "/", "user dir": str(root / "user"), "user file": str(w["notes"]),
         "model config": str(w["model"] / "config.json"), "fifo": str(root / "fifo"), "proc": "/proc/colibri-x"}
    if w["socket"] is not None:
        t["socket"] = str(w["socket"])
    if w["device"] is not None:
        t["device"] = w["device"]
    if writer.source:
        src = w[writer.source]
        t["source"] = str(src)
        t["parent"] = str(src.parent)
        link = root / f"link-to-{writer.source}"
        if not link.is_symlink():
            link.symlink_to(src)
        t["symlink to source"] = str(link)
        if src.is_dir():
            t["inside source"] = str(src / "new")
            t["file in source"] = str(next(p for p in sorted(src.iterdir()) if p.is_file()))
        else:  # a file source: a user's file beside it (gsrc/notes.txt, geo/SENTINEL, ...)
            t["beside source"] = str(next(p for p in sorted(src.parent.iterdir()) if p.is_file() and p != src))
    return {k: v for k, v in t.items() if k not in writer.skip}


def patch_work(monkeypatch, writer: Writer) -> None:
    """The work the output check must precede: reaching it fails the test, whatever the exit code."""
    def started(*a, **k):
        raise AssertionError(f"{writer.id()}: the work started before the output was refused")
    for spec in writer.work:
        module, attr = spec.split(":")
        owner = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        monkeypatch.setattr(owner, name, started)


@pytest.mark.parametrize("writer", WRITERS, ids=Writer.id)
def test_writer_refuses_every_victim(world, writer, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))  # the profile store, outside the world
    monkeypatch.chdir(world["root"] / "cwd")
    patch_work(monkeypatch, writer)
    cases = targets(world, writer)  # first: it makes the symlink to the source
    before = world_digest(world["root"])
    problems = []
    for name, target in cases.items():
        for extra in (([], ["--force"]) if writer.force else ([],)):
            argv = [*writer.argv(world, target), *extra]
            capsys.readouterr()
            rc = cli.main(argv)
            err = capsys.readouterr().err
            lines = [line for line in err.splitlines() if line.strip()]
            one_line = len(lines) == 1 and lines[0].startswith(f"colibri {argv[0]}: error: ")
            if rc != 2 or not one_line or "Traceback" in err:
                problems.append(f"{name} {extra}: exit {rc}: {err.strip()[-400:]!r}")
            if world_digest(world["root"]) != before:
                problems.append(f"{name} {extra}: the world changed")
                break
    assert not problems, f"colibri {writer.id()}:\n" + "\n".join(problems)


# --- cases beyond the matrix -------------------------------------------------------------------------

def test_bench_outcome_refused_is_never_written_and_a_fresh_one_records_the_refusal(world, tmp_path, capsys):
    """The CLI records a failed trial's outcome only in a path the guard passed: a refused --outcome
    (the model's config.json) is not overwritten by the refusal's own record; a fresh one gets it."""
    config = world["model"] / "config.json"
    before = config.read_bytes()
    assert cli.main([*bench("--outcome")(world, str(config))]) == 2
    assert config.read_bytes() == before
    fresh = tmp_path / "outcome.json"
    argv = bench("--outcome")(world, str(fresh))
    argv[argv.index("--tokens") + 1] = "0"  # refused by argparse: before the guard, nothing written
    assert cli.main(argv) == 2 and not fresh.exists()
    assert cli.main([*bench("--outcome")(world, str(fresh)), "--timeout", "5"]) == 2  # refused after the guard
    assert json.loads(fresh.read_text())["kind"] == "bad_config"
    assert cli.main([*bench("--outcome")(world, str(fresh)), "--timeout", "5"]) == 2  # its own record: replaced
    capsys.readouterr()


def test_report_refuses_special_files_where_it_writes(world, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(world["run"], run)
    (run / "report.html").unlink(missing_ok=True)
    os.mkfifo(run / "report.html")
    assert cli.main(["report", str(run), "--json"]) == 2
    assert "report.html exists and is a FIFO" in capsys.readouterr().err
    os.unlink(run / "report.html")
    shutil.rmtree(run / "plots", ignore_errors=True)
    (tmp_path / "elsewhere").mkdir()
    (run / "plots").symlink_to(tmp_path / "elsewhere")
    assert cli.main(["report", str(run), "--json"]) == 2
    assert "plots is a symlink" in capsys.readouterr().err and os.listdir(tmp_path / "elsewhere") == []
    (run / "plots").unlink()
    (run / "plots").mkdir()
    (run / "plots" / "confirmation.png").symlink_to(world["notes"])  # savefig would follow it
    assert cli.main(["report", str(run), "--json"]) == 2
    assert "confirmation.png is a symlink" in capsys.readouterr().err


def test_gguf_convert_leaves_the_users_look_alikes_alone(world, tmp_path, capsys):
    """`DST.partial` and `DST.gguf-bf16` of the user's are refused, never emptied; --force replaces
    a previous import whole, through a temp sibling."""
    dst = tmp_path / "out"
    for sibling in ("out.partial", "out.gguf-bf16"):
        (tmp_path / sibling).mkdir()
        (tmp_path / sibling / "mine.txt").write_text("the user's")
    assert cli.main(["convert", str(world["gguf"]), "-o", str(dst), "--json"]) == 2
    assert "out.partial" in capsys.readouterr().err
    assert cli.main(["convert", str(world["gguf"]), "-o", str(dst), "--quant", "int8", "--json", "--force"]) == 2
    assert "out.gguf-bf16" in capsys.readouterr().err
    for sibling in ("out.partial", "out.gguf-bf16"):
        assert (tmp_path / sibling / "mine.txt").read_text() == "the user's"
        shutil.rmtree(tmp_path / sibling)
    assert cli.main(["convert", str(world["gguf"]), "-o", str(dst), "--json"]) == 0
    first = sorted(p.name for p in dst.iterdir())
    assert cli.main(["convert", str(world["gguf"]), "-o", str(dst), "--json"]) == 2  # without --force: kept
    (dst / "mine.txt").write_text("dropped into the previous output")  # not in its manifest: kept
    assert cli.main(["convert", str(world["gguf"]), "-o", str(dst), "--json", "--force"]) == 2
    assert "mine.txt" in capsys.readouterr().err and (dst / "mine.txt").read_text() == "dropped into the previous output"
    (dst / "mine.txt").unlink()
    assert cli.main(["convert", str(world["gguf"]), "-o", str(dst), "--quant", "int8", "--json", "--force"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["out"] and first and "colibri_quant" in (dst / "config.json").read_text()
    capsys.readouterr()


# The issue's own examples, each as it was reported (the matrix above covers them too, spread out).
ISSUE_EXAMPLES = {
    "convert X.gguf -o . --force (cwd: the GGUF's directory)": (["convert", "{gguf}", "-o", ".", "--force"], "{gdir}"),
    "convert D/x.gguf -o D --force": (["convert", "{gguf}", "-o", "{gdir}", "--force"], None),
    "convert x.gguf -o U --force (U: a user's directory)": (["convert", "{gguf}", "-o", "{user}", "--force"], None),
    "convert x.gguf -o x.gguf": (["convert", "{gguf}", "-o", "{gguf}"], None),
    "bench --outcome config.json": (bench("--outcome")({"model": "{model}"}, "{model}/config.json"), None),
    "bench --read-trace config.json": (bench("--read-trace")({"model": "{model}"}, "{model}/config.json"), None),
    "bench --outcome <device>": (bench("--outcome")({"model": "{model}"}, "{device}"), None),
    "bench --outcome .": (bench("--outcome")({"model": "{model}"}, "."), "{gdir}"),
    "bench --outcome /": (bench("--outcome")({"model": "{model}"}, "/"), None),
    "bench --outcome MODEL_DIR": (bench("--outcome")({"model": "{model}"}, "{model}"), None),
    "bench --outcome /proc/x": (bench("--outcome")({"model": "{model}"}, "/proc/x"), None),
    "bench --outcome ''": (bench("--outcome")({"model": "{model}"}, ""), None),
}


@pytest.mark.parametrize("example", list(ISSUE_EXAMPLES))
def test_the_issues_examples_are_refused(world, example, capsys, monkeypatch):
    argv, cwd = ISSUE_EXAMPLES[example]
    names = {"gguf": world["gguf"], "gdir": world["gguf"].parent, "user": world["root"] / "user",
             "model": world["model"], "device": world["device"]}
    if world["device"] is None and "{device}" in argv:
        pytest.skip("root without mknod: no device here that a failing guard could not harm")
    argv = [a.format(**names) for a in argv]
    monkeypatch.chdir((cwd or "{gdir}").format(**names))
    for spec in (*BENCH_WORK, "engine.format.gguf.importer:GGUFModel"):
        patch_work(monkeypatch, Writer(("", ""), None, work=(spec,), label=example))
    before = world_digest(world["root"])
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"colibri {argv[0]}: error: ") and "Traceback" not in err, err
    assert world_digest(world["root"]) == before
