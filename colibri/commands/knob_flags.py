"""Command-line flags generated from dataclass fields: a knob is one field, its flag follows.

EngineConfig's fields (engine/base/config.py) are `run`/`bench`/`serve`/`chat`'s engine flags;
TuneOptions' fields (tuner/search/options.py) are `tune`'s. Each field's metadata (made by
engine.base.config.knob) names its kind, bounds or choices, help text and, where it differs from
the field's name, its flag; the ranged argparse types are colibri/commands/argtypes.py's, so every
generated numeric flag keeps a range (tests/test_argtypes.py walks the parser).
"""

from __future__ import annotations

import dataclasses

from engine.api import size_label
from colibri.commands.argtypes import add_output_option, duration, finite_float, int_in, seconds, size


def knob_flag(f: dataclasses.Field, with_default: bool = True) -> tuple[str, dict]:
    """The flag of one knob (an EngineConfig or TuneOptions field made with engine.base.config.knob):
    its name and add_argument keywords, from the field's metadata: a ranged type (argtypes) from
    its kind and bounds, or its choices, a switch's action, and its doc as the help with the range
    and default. with_default: the field's default is the flag's (False: None, "not given")."""
    m = f.metadata
    kind, lo, hi = m["kind"], m.get("lo"), m.get("hi")
    name = m.get("flag") or "--" + f.name.replace("_", "-")
    kw: dict = {"dest": f.name}
    if m.get("metavar"):
        kw["metavar"] = m["metavar"]
    if kind == "switch":  # --resume (store_true), --warm / --no-cost-model (store_false)
        kw.update(action="store_false" if f.default else "store_true", default=f.default, help=m["doc"])
        return name, kw
    if with_default:
        kw["default"] = f.default
    if kind == "size":
        bounds = {"hi": hi} if hi is not None else {}
        kw["type"] = size(zero_ok=lo == 0, lo=max(lo or 1, 1), zero_means=m.get("zero_means", ""), **bounds)
    elif kind == "int":
        kw["type"] = int_in(lo, hi, m.get("type_name", "integer"))
    elif kind == "duration":
        kw["type"] = duration()
    elif kind == "seconds":
        kw["type"] = seconds()
    elif kind == "float":
        kw["type"] = finite_float(lo, hi)
    elif kind == "choice":
        kw["choices"] = m["choices"]
    elif kind not in ("path", "text"):
        raise TypeError(f"{f.name}: unknown knob kind {kind!r}")
    default = f.default
    shown = [kw["type"].range_text] if "type" in kw and kind != "size" else []
    if default not in ("", None):
        shown.append(f"default {size_label(default) if kind == 'size' and default else default}")
    kw["help"] = (m["doc"] + (f" ({', '.join(shown)})" if shown else "")).replace("%", "%%")
    if kind == "path":
        kw.setdefault("metavar", "FILE")
    return name, kw


def add_knob_flags(parser, cls, groups: dict | None = None, with_default: bool = True) -> None:
    """One flag per knob field of `cls` (fields without a kind are not flags), each in its
    metadata's group (a name of `groups`: an argparse argument group) or on `parser`."""
    groups = groups or {}
    for f in dataclasses.fields(cls):
        if "kind" not in f.metadata:
            continue
        flag, kw = knob_flag(f, with_default)
        where = groups.get(f.metadata.get("group"), parser)
        if f.metadata.get("output"):  # a knob naming what the command writes (tune --out): declared as such
            add_output_option(where, flag, kind=f.metadata["output"], **kw)
        else:
            where.add_argument(flag, **kw)


def knob_values(args, cls) -> dict:
    """The parsed flags of `cls`'s knobs, by field name (what add_knob_flags added)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if "kind" in f.metadata}
