"""Typed JSON schemas from dataclasses: strict decoding and JSON Schema generation.

The hardware profile (tuner/probe/hardware_profile.py) and the run/trial/tune results
(tuner/results/trial_record.py, result.py) are plain dataclasses with type hints; this module is
the one place that turns such a class into a strict loader (unknown keys, missing keys and wrong
types are one-line errors naming the path) and into a JSON Schema document (docs/schema/*.json,
written by tuner/results/schema.py, checked to be current by tests/test_tuner_parts.py). It sits
below every tuner package that has a schema, so the probe's profile and the results share it
without importing each other. A field may carry `metadata={"unit": "B/s"}`: the loader then
demands that unit of a Quantity, and the schema states it; and value rules the loader checks
(`rules(...)`: closed bounds, a regular expression a string must match, or the strings allowed),
so a document such as a shared profile's best config (tuner/share/profile_schema.py) is checked
by this one validator, from its dataclasses.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from typing import Any, Callable, Literal, Union

from engine.api import ColibriError

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"

# (class, decoded field values, path, unit demanded by the parent field) -> values, or raise
Check = Callable[[type, dict, str, "str | None"], dict]


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string",
            list: "array", dict: "object"}.get(type(value), type(value).__name__)


# --- strict decoding ------------------------------------------------------------------------

def decode(tp: Any, data: Any, path: str, error: type[ColibriError], check: Check | None = None,
           unit: str | None = None) -> Any:
    """`data` (parsed JSON) as an instance of `tp`, or `error` naming the first bad path."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return _check_json_value(data, path, error)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if data is None:
            if type(None) in args:
                return None
            raise error(f"{path}: must not be null")
        (inner,) = [a for a in args if a is not type(None)]
        return decode(inner, data, path, error, check, unit)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if data not in allowed or type(data) is not type(allowed[0]):
            raise error(f"{path}: {data!r} is not one of {', '.join(map(repr, allowed))}")
        return data
    if origin is list:
        if not isinstance(data, list):
            raise error(f"{path}: expected an array, got {json_type(data)}")
        (item,) = typing.get_args(tp)
        return [decode(item, x, f"{path}[{i}]", error, check) for i, x in enumerate(data)]
    if origin is dict:
        if not isinstance(data, dict):
            raise error(f"{path}: expected an object, got {json_type(data)}")
        _, value_tp = typing.get_args(tp)
        return {k: decode(value_tp, v, f"{path}.{k}", error, check) for k, v in data.items()}
    if dataclasses.is_dataclass(tp):
        return _decode_dataclass(tp, data, path, error, check, unit)
    return _decode_scalar(tp, data, path, error)


def _decode_dataclass(cls: type, data: Any, path: str, error, check, unit) -> Any:
    if not isinstance(data, dict):
        raise error(f"{path}: expected an object, got {json_type(data)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise error(f"{path}: unknown key {unknown[0]!r}")
    # A field marked optional (metadata {"optional": True}) may be absent: its default applies.
    missing = [name for name in fields if name not in data and not fields[name].metadata.get("optional")]
    if missing:
        raise error(f"{path}: missing key {missing[0]!r}")
    hints = typing.get_type_hints(cls)
    values = {name: decode(hints[name], data[name], f"{path}.{name}", error, check, f.metadata.get("unit"))
              for name, f in fields.items() if name in data}
    for name, value in values.items():
        _check_rules(fields[name].metadata, value, f"{path}.{name}", error)
    if check is not None:
        values = check(cls, values, path, unit)
    return cls(**values)


def with_defaults(tp: Any, value: Any) -> Any:
    """`value` (parsed JSON of type `tp`, changed in place) with every absent field that has a
    default set to it, in nested dataclasses and lists too: what a schema migration does for the
    fields a newer version added with defaults (tuner/results/result.py migrate). A field without
    a default stays absent, for `decode` to refuse."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return with_defaults(inner, value)
    if origin is list and isinstance(value, list):
        (item,) = typing.get_args(tp)
        return [with_defaults(item, v) for v in value]
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        hints = typing.get_type_hints(tp)
        for f in dataclasses.fields(tp):
            if f.name in value:
                value[f.name] = with_defaults(hints[f.name], value[f.name])
            elif f.default is not dataclasses.MISSING:
                value[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                value[f.name] = f.default_factory()
    return value


def rules(*, bounds: tuple | None = None, pattern: re.Pattern | None = None, choices: tuple | None = None,
          **meta) -> dict:
    """Field metadata with the value rules decode() checks: `bounds` (lo, hi) closed, for a
    number; `pattern`, a regular expression a string must match; `choices`, the strings allowed.
    Other keywords (optional, unit, doc, ...) pass through."""
    return {**meta, **({"bounds": bounds} if bounds else {}), **({"pattern": pattern} if pattern else {}),
            **({"choices": choices} if choices else {})}


def _check_rules(meta, value: Any, path: str, error) -> None:
    if value is None:
        return
    if "bounds" in meta:
        lo, hi = meta["bounds"]
        if not lo <= value <= hi:
            raise error(f"{path}: {value} is outside [{lo:g}, {hi:g}]")
    if "pattern" in meta and not meta["pattern"].match(value):
        raise error(f"{path}: {value!r} is not of the form {meta['pattern'].pattern}"[:300])
    if "choices" in meta and value not in meta["choices"]:
        raise error(f"{path}: {value!r} is not one of {', '.join(map(repr, meta['choices']))}"[:300])


def _decode_scalar(tp: Any, data: Any, path: str, error) -> Any:
    if tp is bool:
        ok = isinstance(data, bool)
    elif tp is int:
        ok = isinstance(data, int) and not isinstance(data, bool)
    elif tp is float:
        ok = isinstance(data, (int, float)) and not isinstance(data, bool) and math.isfinite(data)
        data = float(data) if ok else data
    elif tp is str:
        ok = isinstance(data, str)
    else:
        raise TypeError(f"schema uses an unsupported type {tp!r} at {path}")
    if not ok:
        name = {bool: "boolean", int: "integer", float: "finite number", str: "string"}[tp]
        raise error(f"{path}: expected {name}, got {json_type(data)} {data!r}"[:200])
    return data


def _check_json_value(data: Any, path: str, error) -> Any:
    if isinstance(data, dict):
        for k, v in data.items():
            _check_json_value(v, f"{path}.{k}", error)
    elif isinstance(data, list):
        for i, v in enumerate(data):
            _check_json_value(v, f"{path}[{i}]", error)
    elif isinstance(data, float) and not math.isfinite(data):
        raise error(f"{path}: NaN and infinity are not valid JSON")
    elif not isinstance(data, (str, int, float, bool, type(None))):
        raise error(f"{path}: {json_type(data)} is not a JSON value")
    return data


# --- JSON Schema ----------------------------------------------------------------------------

def json_schema(cls: type, schema_id: str, title: str, description: str = "") -> dict:
    """A JSON Schema (2020-12) document for dataclass `cls`, nested dataclasses under $defs."""
    defs: dict[str, dict] = {}
    root = _object_schema(cls, defs)
    doc = {"$schema": JSON_SCHEMA_DIALECT, "$id": schema_id, "title": title}
    if description:
        doc["description"] = description
    doc.update(root)
    if defs:
        doc["$defs"] = dict(sorted(defs.items()))
    return doc


def _object_schema(cls: type, defs: dict) -> dict:
    hints = typing.get_type_hints(cls)
    props = {}
    for f in dataclasses.fields(cls):
        prop = _type_schema(hints[f.name], defs)
        if f.metadata.get("unit"):
            prop = {**prop, "description": f"unit: {f.metadata['unit']}"}
        if f.metadata.get("doc"):
            prop = {**prop, "description": f.metadata["doc"]}
        props[f.name] = prop
    out = {"type": "object", "properties": props,
           "required": [f.name for f in dataclasses.fields(cls) if not f.metadata.get("optional")],
           "additionalProperties": False}
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):
        out = {"description": " ".join(cls.__doc__.split()), **out}
    return out


def _type_schema(tp: Any, defs: dict) -> dict:
    origin = typing.get_origin(tp)
    if tp is Any:
        return {}
    if origin in (Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        (one,) = inner
        return {"anyOf": [_type_schema(one, defs), {"type": "null"}]}
    if origin is Literal:
        return {"enum": list(typing.get_args(tp))}
    if origin is list:
        (item,) = typing.get_args(tp)
        return {"type": "array", "items": _type_schema(item, defs)}
    if origin is dict:
        _, value_tp = typing.get_args(tp)
        return {"type": "object", "additionalProperties": _type_schema(value_tp, defs)}
    if dataclasses.is_dataclass(tp):
        if tp.__name__ not in defs:
            defs[tp.__name__] = {}  # placeholder first: a class may refer to itself
            defs[tp.__name__] = _object_schema(tp, defs)
        return {"$ref": f"#/$defs/{tp.__name__}"}
    scalar = {bool: "boolean", int: "integer", float: "number", str: "string"}.get(tp)
    if scalar is None:
        raise TypeError(f"schema uses an unsupported type {tp!r}")
    return {"type": scalar}
