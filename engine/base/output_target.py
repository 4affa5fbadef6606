"""Where a command may write: the one set of rules every writing command checks before it starts.

A tool that streams 400 GB models must never delete what it did not write. So an output target
(a directory that `convert`, `synth`, `tune` or `compare` fills, or a file that `probe -o` or
`profile export -o` writes) is refused, with one line naming the rule, when it is:

- empty text ("" would mean the current directory), the current directory, or `/`;
- a source of the command (the model being converted, the run being exported), inside one, or
  an ancestor of one (replacing it would take the source with it);
- for a directory output: an existing file, or a non-empty directory that is not a previous
  output of the same command. A previous output is recognised by its stamp (the key its config
  or record carries, see `stamped`); `--force` replaces only such a directory, never another;
- for a file output: a directory or a special file (FIFO, device, socket), an existing file that
  is not a previous output of the same kind, or a path whose directory does not exist;
- for files a command writes inside a directory it was given (`report`'s report.md, ...): any of
  them that exists as something else than what the command writes there (`in_place_files`);
- somewhere this process cannot write (a read-only directory): refused now, not after the work.

Nothing here opens the target: a FIFO or a device is refused from its `stat`, so `/dev/full` or a
FIFO is never written to, blocked on or replaced. Every flag that names an output is declared with
colibri/commands/argtypes.add_output_option, which records the rule it goes through
(OUTPUT_KINDS); tests/test_writer_guard.py walks the CLI's parsers and fails on a writer that is
not declared, then aims every declared one at each kind of victim.

Symlinks are resolved first, so a link to the source is the source. The directory is then filled
in a fresh temporary sibling and renamed into place (`replace_directory`); files are written with
engine/base/durable.py's temp file + rename. A replaced previous output is moved aside, the new one
renamed in, and only then is the old one removed, after checking again that it still is ours.
A directory output carries MANIFEST, the names of everything the command put in it: a previous
output that now holds anything else (a file the user dropped in) is not replaced, even with
--force. (An output written before the manifest existed is recognised by its stamp alone.)
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from engine.base.durable import atomic_write_text, fsync_dir
from engine.base.errors import ConfigError

STAMP_MAX_BYTES = 16 << 20  # a config.json / run record read to find a stamp; real ones are KiB
MANIFEST = ".colibri-output"  # in a directory output: {"command": ..., "entries": [what we wrote]}
# The temp sibling is ".<name>.<random>.tmp": a name near the filesystem's 255-byte limit would be
# accepted here and then fail in the middle of the write, after the work.
NAME_MAX_BYTES = 200

# How each declared output option is checked (colibri/commands/argtypes.add_output_option's `kind`).
OUTPUT_KINDS = {
    "file": "file_target: a fresh path, or a previous output of the same kind (its stamp); temp + rename",
    "directory": "directory_target: a fresh or empty directory, or (--force) a previous output; "
                 "built in a temp sibling and renamed",
    "run directory": "run_directory_target: a fresh or empty directory, or a previous run reused in place",
    "in place": "in_place_files: the files a command writes inside a directory it was given",
    "scratch": "a directory where a uniquely named test file is created (O_EXCL) and removed",
}

Recogniser = Callable[[Path], bool]  # True when the path holds a previous output of this command


class OutputTargetError(ConfigError):
    """An output path that would overwrite or delete something the command did not write."""


@dataclass(frozen=True)
class DirectoryTarget:
    path: Path  # absolute, symlinks resolved
    command: str  # "convert", "synth", ... for messages and the temp siblings' names
    recognise: Recogniser
    replaces: bool  # a previous output is there and will be replaced (only with force)

    def sibling(self, suffix: str) -> Path:
        """A temp sibling in the same directory (so the final rename never crosses filesystems)."""
        return self.path.parent / f"{self.path.name}.{suffix}"


def resolved(raw: str | os.PathLike, flag: str) -> Path:
    """The absolute path with every symlink resolved; empty text is refused (it means '.')."""
    text = os.fspath(raw)
    if not str(text).strip():
        raise OutputTargetError(f"{flag}: empty path (it would mean the current directory)")
    if "\0" in str(text):
        raise OutputTargetError(f"{flag}: the path holds a NUL character")
    try:
        path = Path(text).expanduser().resolve(strict=False)
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise OutputTargetError(f"{flag} {text}: cannot resolve the path ({exc})") from None
    if len(path.name.encode("utf-8", "surrogateescape")) > NAME_MAX_BYTES:
        raise OutputTargetError(f"{flag}: the name {path.name[:40]}... is longer than {NAME_MAX_BYTES} bytes")
    return path


def _cwd() -> Path | None:
    try:
        return Path.cwd().resolve()
    except OSError:  # the current directory was deleted
        return None


def check_not_source(target: Path, sources: Iterable[str | os.PathLike], flag: str, what: str = "the output") -> None:
    """Refuse a target that is a source, inside one, or an ancestor of one (all resolved)."""
    for raw in sources:
        if raw is None or not str(raw):
            continue
        try:
            src = Path(raw).expanduser().resolve(strict=False)
        except (OSError, RuntimeError) as exc:  # a source that is a symlink loop
            raise OutputTargetError(f"{raw}: cannot resolve the path ({exc})") from None
        if target == src:
            raise OutputTargetError(f"{flag} {target}: {what} is the source {src}; choose another path")
        if src in target.parents:
            raise OutputTargetError(f"{flag} {target}: {what} is inside the source {src}; choose a path outside it")
        if target in src.parents:
            raise OutputTargetError(f"{flag} {target}: {what} contains the source {src}; replacing it would "
                                    "delete the source")


def _check_common(target: Path, sources, flag: str) -> None:
    if target == Path(target.anchor):
        raise OutputTargetError(f"{flag} {target}: refusing to write to the root directory")
    if target == _cwd():
        raise OutputTargetError(f"{flag} {target}: refusing to write to the current directory itself; "
                                "name a new subdirectory")
    check_not_source(target, sources, flag)


def _check_writable(target: Path, flag: str) -> None:
    """The nearest existing ancestor must be a writable directory (we create the rest)."""
    parent = target.parent
    while not os.path.lexists(parent):
        parent = parent.parent
    if not parent.is_dir():
        raise OutputTargetError(f"{flag} {target}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputTargetError(f"{flag} {target}: directory {parent} is not writable")
    # os.access says yes to root everywhere, and nothing of a read-only mount or of /proc: try it.
    try:
        fd, probe = tempfile.mkstemp(prefix=".colibri-write-check-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputTargetError(f"{flag} {target}: cannot create files in {parent} "
                                f"({exc.strerror or exc})") from None


def _kind_of(st: os.stat_result) -> str:
    m = st.st_mode
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(m):
            return name
    return "a file" if stat.S_ISREG(m) else "not a regular file"


def _target(raw: str | os.PathLike, sources, flag: str, *, directory: bool) -> tuple[Path, bool]:
    """The resolved target, its common checks passed, and whether it exists; one that exists as
    another kind of thing than the output (a directory, or a regular file) is refused here."""
    target = resolved(raw, flag)
    _check_common(target, sources, flag)
    try:
        if not os.path.lexists(target):
            return target, False
        st = os.stat(target)  # stat, never open: a FIFO would block, a device would take the bytes
    except OSError as exc:  # a dangling link's target dir unreadable, a name the filesystem refuses
        raise OutputTargetError(f"{flag} {target}: cannot use this path ({exc.strerror or exc})") from None
    if directory and not stat.S_ISDIR(st.st_mode):
        raise OutputTargetError(f"{flag} {target}: exists and is {_kind_of(st)}, not a directory")
    if not directory and not stat.S_ISREG(st.st_mode):
        raise OutputTargetError(f"{flag} {target}: exists and is {_kind_of(st)}, not a file it may replace")
    return target, True


def directory_target(raw: str | os.PathLike, *, command: str, recognise: Recogniser, sources=(),
                     force: bool = False, flag: str = "-o") -> DirectoryTarget:
    """Check a directory output before any work; returns where to write. See the module doc."""
    target, exists = _target(raw, sources, flag, directory=True)
    replaces = False
    if exists:
        if any(os.scandir(target)):
            if not recognise(target):
                raise OutputTargetError(f"{flag} {target}: is not empty and is not a previous `colibri {command}` "
                                        "output; refusing to replace it (even with --force)")
            if not force:
                raise OutputTargetError(f"{flag} {target}: is not empty: it holds a previous `colibri {command}` "
                                        "output (use --force to replace it)")
            _check_nothing_added(target, command, flag)
            replaces = True
            if not os.access(target, os.W_OK | os.X_OK):
                raise OutputTargetError(f"{flag} {target}: the previous output is read-only; cannot replace it")
    _check_writable(target, flag)
    return DirectoryTarget(target, command, recognise, replaces)


def run_directory_target(raw: str | os.PathLike, *, command: str, recognise: Recogniser, sources=(),
                         flag: str = "--out") -> Path:
    """A directory a command keeps writing into over time (a tune run): the same refusals, but a
    previous output of the command is reused in place (resume), never replaced."""
    target, exists = _target(raw, sources, flag, directory=True)
    if exists:
        if any(os.scandir(target)) and not recognise(target):
            raise OutputTargetError(f"{flag} {target}: a non-empty directory that is not a previous "
                                    f"`colibri {command}` run directory; choose a new or empty one")
        if not os.access(target, os.W_OK | os.X_OK):
            raise OutputTargetError(f"{flag} {target}: directory is not writable")
    _check_writable(target, flag)
    return target


def file_target(raw: str | os.PathLike, *, command: str, recognise: Recogniser | None, sources=(),
                flag: str = "-o") -> Path:
    """Check a single-file output. An existing file is replaced only when `recognise` says it is a
    previous output of this kind (recognise None: any existing regular file is refused). Its
    directory must exist: a typo'd path is refused, not created."""
    target, exists = _target(raw, sources, flag, directory=False)
    if not target.parent.is_dir():
        raise OutputTargetError(f"{flag} {target}: {target.parent} is not an existing directory")
    if exists:
        if recognise is None or not recognise(target):
            raise OutputTargetError(f"{flag} {target}: an existing file that is not a previous `colibri {command}` "
                                    "output; refusing to overwrite it")
        if not os.access(target.parent, os.W_OK | os.X_OK):
            raise OutputTargetError(f"{flag} {target}: directory {target.parent} is not writable")
    _check_writable(target, flag)
    return target


def in_place_files(directory: str | os.PathLike, entries: dict[str, str], *, command: str,
                   flag: str) -> Path:
    """Check the files a command (re)writes inside a directory it was given (`report RUN_DIR`: its
    report.md, report.html and plots/): each one that exists must be what the command writes there,
    a regular file ("file") or a real directory ("dir"), never a FIFO, device or a symlink to a
    directory elsewhere (mkdir would follow it and the writes land outside). The directory itself is
    the command's input and recognised by it (e.g. a tune run)."""
    base = resolved(directory, flag)
    for name, kind in entries.items():
        path = base / name
        try:
            if not os.path.lexists(path):
                continue
            st = os.lstat(path)
        except OSError as exc:
            raise OutputTargetError(f"{flag} {base}: cannot use {name} ({exc.strerror or exc})") from None
        if stat.S_ISLNK(st.st_mode) and kind == "dir":
            raise OutputTargetError(f"{flag} {base}: {name} is a symlink; refusing to write through it")
        if kind == "dir" and not stat.S_ISDIR(st.st_mode):
            raise OutputTargetError(f"{flag} {base}: {name} exists and is {_kind_of(st)}, not the directory "
                                    f"`colibri {command}` writes; refusing to write into it")
        if kind == "file" and not stat.S_ISREG(st.st_mode) and not stat.S_ISLNK(st.st_mode):
            raise OutputTargetError(f"{flag} {base}: {name} exists and is {_kind_of(st)}, not a file "
                                    f"`colibri {command}` may replace")
        if kind == "dir":  # the files written in it (plots, not atomically): a FIFO there would block
            for entry in os.scandir(path):  # the write, a symlink would take it to a file elsewhere
                est = entry.stat(follow_symlinks=False)
                if not (stat.S_ISREG(est.st_mode) or stat.S_ISDIR(est.st_mode)):
                    what = "a symlink" if stat.S_ISLNK(est.st_mode) else _kind_of(est)
                    raise OutputTargetError(f"{flag} {base}: {name}/{entry.name} is {what}; "
                                            f"refusing to write beside it")
    _check_writable(base / next(iter(entries)), flag)
    return base


def _entries(directory: Path) -> list[str]:
    """Every name under `directory` (relative, directories with a trailing /), the manifest aside."""
    out = []
    for root, dirs, files in os.walk(directory):
        rel = os.path.relpath(root, directory)
        prefix = "" if rel == "." else rel + "/"
        out += [prefix + d + "/" for d in dirs] + [prefix + f for f in files if prefix or f != MANIFEST]
    return sorted(out)


def _check_nothing_added(path: Path, command: str, flag: str) -> None:
    """A previous output about to be replaced must hold only what its manifest lists."""
    manifest = read_small_json(path / MANIFEST)
    if manifest is None:
        return  # an output from before the manifest: its stamp is all there is
    listed = set(manifest.get("entries") or []) if isinstance(manifest, dict) else set()
    added = [e for e in _entries(path) if e not in listed]
    if added:
        shown = ", ".join(added[:3]) + (f" and {len(added) - 3} more" if len(added) > 3 else "")
        where = f"{flag} {path}" if flag else str(path)
        raise OutputTargetError(f"{where}: a previous `colibri {command}` output, but it now holds {shown}, "
                                "which colibri did not write; refusing to replace it (even with --force): move "
                                "those out or choose another path")


def replace_directory(tmp: Path, target: DirectoryTarget) -> None:
    """Rename the finished `tmp` to the target. What is there now must still be empty or a previous
    output (it was checked at the start; a user may have put something there since): it is moved
    aside, the new directory renamed in, and the old one removed only then."""
    path = target.path
    atomic_write_text(tmp / MANIFEST, json.dumps({"command": target.command, "entries": _entries(tmp)}) + "\n")
    old = None
    if os.path.lexists(path):
        if not path.is_dir() or path.is_symlink():
            raise OutputTargetError(f"{path}: became something other than a directory while `colibri "
                                    f"{target.command}` ran; the new output is left in {tmp}")
        if any(os.scandir(path)):
            if not (target.replaces and target.recognise(path)):
                raise OutputTargetError(f"{path}: filled with other files while `colibri {target.command}` ran; "
                                        f"not replacing it; the new output is left in {tmp}")
            try:
                _check_nothing_added(path, target.command, "")
            except OutputTargetError as exc:
                raise OutputTargetError(f"{exc}; the new output is left in {tmp}") from None
            old = target.sibling(f"old-{os.getpid()}")
            os.replace(path, old)
        else:
            path.rmdir()
    os.replace(tmp, path)
    fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --- stamps: how a previous output of each command is recognised ----------------------------------

def read_small_json(path: Path):
    """A regular file's JSON, or None when it is missing, too big, special or not JSON (not ours)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > STAMP_MAX_BYTES:
            return None
        with open(path, "rb") as f:
            return json.loads(f.read(STAMP_MAX_BYTES + 1).decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return None


def stamped(file_name: str, key: str, value: object = None) -> Recogniser:
    """A recogniser: `<dir>/<file_name>` is a JSON object holding `key` (equal to `value` if given)."""
    def recognise(directory: Path) -> bool:
        data = read_small_json(Path(directory) / file_name)
        if not isinstance(data, dict) or key not in data:
            return False
        return value is None or data[key] == value
    return recognise


def json_file_with(*keys: str) -> Recogniser:
    """A recogniser for a file output: a JSON object holding every one of `keys`."""
    def recognise(path: Path) -> bool:
        data = read_small_json(Path(path))
        return isinstance(data, dict) and all(k in data for k in keys)
    return recognise


def json_lines_head_with(**fields) -> Recogniser:
    """A recogniser for a JSON Lines output: its first line is a JSON object with these values
    (a read trace's header: {"format": "colibri-read-trace", ...}). Only the first line is read."""
    def recognise(path: Path) -> bool:
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                return False
            with open(path, "rb") as f:
                head = json.loads(f.readline(STAMP_MAX_BYTES).decode("utf-8"))
        except (OSError, ValueError, RecursionError):
            return False
        return isinstance(head, dict) and all(head.get(k) == v for k, v in fields.items())
    return recognise


def any_of(*recognisers: Recogniser) -> Recogniser:
    return lambda path: any(r(path) for r in recognisers)
