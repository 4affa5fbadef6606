"""A tune run directory while a tune uses it: where it may be, who holds it, whether it still exists.

- `tune_out(raw, sources)`: engine/base/output_target.py's rules for a run directory (never the
  model, the profile, the current directory or `/`; a non-empty directory only when it is a
  previous tune run, recognised by its run.json, result.json, study.db or calibration.json). Checked before the
  run creates anything, so a refused run leaves nothing behind.
- `hold(out)`: an exclusive lock on the run directory for the whole run (engine/base/durable.py's
  DirectoryLock, not waiting). Two tunes sharing one `--out` used to meet inside Optuna's SQLite
  file as a StorageInternalError traceback; the second is now refused with one line naming the
  first.
- `RunDirWatch`: notices the run directory being deleted (or replaced) under a live run, so the
  run stops with one line instead of failing in the study storage or writing its files into a
  directory re-created on the fly.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from engine.api import BusyError, ColibriError, DirectoryLock, any_of, lock_path_for, run_directory_target, stamped


class RunDirGone(ColibriError):
    """The run directory was deleted or replaced while the run was using it."""


def _has(name: str):
    return lambda path: (Path(path) / name).is_file()


# run.json is the stamp since it exists; result.json / study.db mark runs made before it, and a
# directory holding only calibration.json is one whose first session stopped before its study.
TUNE_RUN = any_of(stamped("run.json", "schema", "colibri.run/1"), _has("result.json"), _has("study.db"),
                  stamped("calibration.json", "model_dir"))
QUANT_RUN = stamped("quant-run.json", "schema", "colibri.tune-quant/1")


def tune_out(raw: str | os.PathLike, sources=(), recognise=TUNE_RUN) -> Path:
    return run_directory_target(raw, command="tune", recognise=recognise, sources=sources, flag="--out")


@contextmanager
def hold(out: Path, purpose: str):
    """Exclusive use of `out` while the block runs; a second holder is refused at once."""
    lock = DirectoryLock(out, purpose, timeout=0, on_wait=lambda message: None)
    try:
        lock.__enter__()
    except BusyError:  # only the lock's own: a BusyError from inside the block is not about `out`
        raise BusyError(f"--out {out}: another `colibri tune` is using this run directory ({_holder(out)}); "
                        "wait for it to finish or choose another --out") from None
    try:
        yield lock
    finally:
        lock.__exit__(None, None, None)


def _holder(out: Path) -> str:
    try:
        fd = os.open(lock_path_for(out), os.O_RDONLY)
    except OSError:
        return "another process"
    try:
        return DirectoryLock.holder(fd)
    finally:
        os.close(fd)


class RunDirWatch:
    """The identity (device, inode) of the run directory as the run started using it, and a
    handle on it: files written through `write_text` go into that directory or nowhere (a path
    write would re-create a deleted directory on the fly and carry on there)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.fd = os.open(self.out, os.O_RDONLY | os.O_DIRECTORY)
        st = os.fstat(self.fd)
        self.identity = (st.st_dev, st.st_ino)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def write_text(self, name: str, text: str) -> None:
        """Atomically (temp file + fsync + rename + directory fsync), relative to the held directory."""
        tmp = f".{name}.{os.getpid()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=self.fd)
        except FileNotFoundError:  # the directory was deleted: no new entries can be made in it
            raise self.gone_error() from None
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(text.encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except BaseException as exc:
            try:
                os.unlink(tmp, dir_fd=self.fd)
            except OSError:
                pass
            # Deleted between the open and the rename (an rmtree took the temp file with it): the
            # directory is gone, and that is what the user is told, not a rename's traceback.
            if isinstance(exc, FileNotFoundError) and self.gone():
                raise self.gone_error() from None
            raise
        os.fsync(self.fd)
        self.check()

    def gone(self) -> bool:
        try:
            st = os.stat(self.out)
        except OSError:
            return True
        return (st.st_dev, st.st_ino) != self.identity

    def gone_error(self) -> RunDirGone:
        return RunDirGone(f"the run directory {self.out} was deleted or replaced while tune was running; "
                          "stopped (its study and files went with it)")

    def check(self) -> None:
        if self.gone():
            raise self.gone_error()
