"""Join a cgroup, then become the real command.

Usage: python -I -S _exec.py <cgroup.procs file> <status fd> -- <argv...>

tuner/sandbox/limited.py runs this file by path (not `-m tuner.sandbox._exec`) so that joining the
cgroup imports nothing but os and sys: the tuner package imports optuna and torch, and the
shim must not depend on the caller's cwd or PYTHONPATH. Joining happens before exec, so every
page the command touches is charged to the cgroup. The interpreter's own start-up (a few MB) is
charged to the parent cgroup, and exec throws it away.

The status fd is close-on-exec: a successful exec closes it with nothing written, so the parent
reads EOF. Otherwise one line "<stage>:<errno>:<message>" tells it why, and we exit 127. This is
how the parent tells "the command ran and exited 127" from "the command never ran limited".
"""

import os
import sys


def _fail(status_fd: int, stage: str, err: OSError) -> None:
    line = f"{stage}:{err.errno or 0}:{err.strerror or err}\n"
    try:
        os.write(status_fd, line.encode("utf-8", "replace"))
    finally:
        os._exit(127)


def main(args: list[str]) -> None:
    if len(args) < 4 or args[2] != "--":
        sys.stderr.write("usage: _exec.py PROCS_FILE STATUS_FD -- ARGV...\n")
        os._exit(2)
    procs_file, status_fd, argv = args[0], int(args[1]), args[3:]
    os.set_inheritable(status_fd, False)
    try:
        fd = os.open(procs_file, os.O_WRONLY)
        try:
            os.write(fd, str(os.getpid()).encode())
        finally:
            os.close(fd)
    except OSError as err:
        _fail(status_fd, "join", err)
    try:
        os.execvp(argv[0], argv)
    except OSError as err:
        _fail(status_fd, "exec", err)


if __name__ == "__main__":
    main(sys.argv[1:])
