"""Reading a file a user names: regular files only, a size cap per kind, strict UTF-8.

Why: `quality --text /dev/zero` read until the machine ran out of memory, `plan --profile
/dev/zero` hung at 8 GB, and a FIFO given as a profile blocked `open()` forever. Every reader
of a user file goes through `read_input` (or `open_input` when it reads only part of the file,
as a safetensors shard's header), so each of those is one line naming the path and what it is.

The checks, in order: `os.stat` says what the path is before anything opens it (a FIFO,
character or block device, socket or directory is named as such and never opened, since
opening a FIFO blocks until a writer comes); the open is O_NONBLOCK and the descriptor is
checked again with `fstat`, so a FIFO swapped in between the two calls cannot block us either;
the size is compared with the kind's cap before a byte is read, and reading stops at the cap
even if the file grows meanwhile.

`printable` is the other half of handling what files bring: names read from files (model,
profile and tensor names) are printed through it, so a terminal escape sequence in a name
cannot rewrite the screen of whoever runs the command.
"""

from __future__ import annotations

import os
import re
import stat

from engine.base.errors import ColibriError

KiB, MiB = 1 << 10, 1 << 20

# Size caps per kind of input: far above any real file of that kind, far below what would hurt
# a 16 GB machine. A DeepSeek-V3 config.json is 2 KiB, its index 2 MiB, a shard's safetensors
# header < 1 MiB; a large tokenizer.json (Qwen3, GLM-5) is 10-20 MiB; a tune run's result.json
# is a few hundred KiB and its trials.csv ~1 KiB per trial.
LIMITS: dict[str, int] = {
    "config.json": 16 * MiB,
    "safetensors index": 64 * MiB,
    # the safetensors library's own cap on a header (and ours, engine/format/checkpoint.py)
    "safetensors header": 100_000_000,
    "geometry": 4 * MiB,
    "profile": 1 * MiB,
    "engine config": 1 * MiB,  # TOML
    "result.json": 64 * MiB,
    "trials.csv": 64 * MiB,
    "routing histogram": 64 * MiB,
    "tokenizer.json": 64 * MiB,
    "text corpus": 64 * MiB,  # quality --text: 64 MiB is ~16M tokens, far more than any --tokens
    "conversion state": 1 * MiB,
    "calibration": 16 * MiB,
}

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def what_it_is(mode: int) -> str:
    """'a directory', 'a FIFO (named pipe)', ... for a stat mode that is not a regular file."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _not_regular(error: type[ColibriError], path, kind: str, mode: int) -> ColibriError:
    return error(f"{path}: is {what_it_is(mode)}, not a regular file (expected a {kind} file)")


def open_input(path: str | os.PathLike, kind: str, error: type[ColibriError] = ColibriError) -> tuple[int, int]:
    """Open a user file for reading → (fd, size). The caller closes fd.

    Refuses, with one `error` line naming the path: a missing path, one that is not a regular
    file (named: directory, FIFO, device, socket), one we may not read.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise error(f"{path}: no such file ({kind})") from None
    except NotADirectoryError:
        raise error(f"{path}: no such file ({kind}; a parent is not a directory)") from None
    except OSError as exc:  # ELOOP (a symlink loop), EACCES on a parent, ENAMETOOLONG...
        raise error(f"{path}: cannot read {kind}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(error, path, kind, st.st_mode)
    try:
        # O_NONBLOCK: a FIFO put in place after the stat opens at once instead of waiting for a
        # writer; for a regular file the flag changes nothing.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise error(f"{path}: cannot read {kind}: {exc.strerror or exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise _not_regular(error, path, kind, st.st_mode)
    return fd, st.st_size


def check_regular(path: str | os.PathLike, kind: str, error: type[ColibriError] = ColibriError) -> int:
    """The same refusals as open_input, for a file another layer opens itself; → its size."""
    fd, size = open_input(path, kind, error)
    os.close(fd)
    return size


def read_input(path: str | os.PathLike, kind: str, error: type[ColibriError] = ColibriError,
               limit: int | None = None) -> bytes:
    """The whole of a user file of this kind, no larger than its cap (LIMITS[kind] or limit)."""
    cap = LIMITS[kind] if limit is None else limit
    fd, size = open_input(path, kind, error)
    try:
        if size > cap:
            raise error(f"{path}: {size} bytes is over the {_size(cap)} limit for a {kind}")
        chunks, got = [], 0
        while got <= cap:  # a file growing while we read stops at the cap, not at the disk's end
            try:
                chunk = os.read(fd, min(cap + 1 - got, 4 * MiB))
            except OSError as exc:
                raise error(f"{path}: cannot read {kind}: {exc.strerror or exc}") from None
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > cap:
            raise error(f"{path}: grew past the {_size(cap)} limit for a {kind} while being read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def decode_utf8(raw: bytes, path, kind: str, error: type[ColibriError] = ColibriError) -> str:
    """Strict UTF-8 (no replacement characters): the byte offset of the first bad byte in the error."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{path}: {kind} is not UTF-8 text (invalid byte 0x{raw[exc.start]:02x} at offset "
                    f"{exc.start})") from None


def read_text_input(path: str | os.PathLike, kind: str, error: type[ColibriError] = ColibriError,
                    limit: int | None = None) -> str:
    """read_input, decoded as strict UTF-8."""
    return decode_utf8(read_input(path, kind, error, limit), path, kind, error)


def _size(n: int) -> str:
    return f"{n}-byte"


# --- names from files, on a terminal ---------------------------------------------------------

# C0 and C1 controls and DEL, plus the Unicode format characters that reorder or hide text
# (bidi overrides and isolates, zero-width joiners): a name printed with them can show the
# reader something other than what the file holds.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069\ufeff]")


def printable(name, limit: int = 200) -> str:
    """A name from a file, safe to print: control and bidi characters as \\xNN / \\uNNNN escapes,
    and at most `limit` characters (a megabyte-long name is not a name)."""
    text = str(name)
    if len(text) > limit:
        text = text[:limit] + f"...({len(text) - limit} more characters)"
    return _UNSAFE.sub(_escape, text)


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"
