"""A directory nobody may create files in, root included: for the tests of unwritable outputs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def make_read_only(path: Path) -> str | None:
    """Make `path` (a directory) one nobody may create files in, root included; None when done,
    else why not. Mode 555 stops everyone but root (root ignores permission bits), so as root the
    directory is made immutable instead (chattr +i: not even root can add an entry until the flag
    is removed); a filesystem without the flag (tmpfs before Linux 6.0, overlayfs) cannot."""
    if os.geteuid() != 0:
        path.chmod(0o555)
        return None
    chattr = shutil.which("chattr")
    if chattr is None:
        return "running as root and chattr is not installed"
    done = subprocess.run([chattr, "+i", str(path)], capture_output=True, text=True)
    if done.returncode != 0:
        return f"running as root and {path} does not take chattr +i ({done.stderr.strip()[-200:]})"
    return None


def undo_read_only(path: Path) -> None:
    if os.geteuid() != 0:
        path.chmod(0o755)
    else:
        subprocess.run([shutil.which("chattr") or "chattr", "-i", str(path)], check=True, capture_output=True)
