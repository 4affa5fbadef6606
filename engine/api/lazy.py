"""How the door's names resolve: lazily (PEP 562), from the one home each has (engine/api/__init__.py)."""

from __future__ import annotations

import importlib


def homes(table: dict[str, str]) -> dict[str, str]:
    """{home module: "name name ..."} -> {name: home module}."""
    return {name: module for module, names in table.items() for name in names.split()}


def resolver(door: str, home: dict[str, str]):
    """The door module's `__getattr__`: a name's current value in its home module (not cached, so a
    test that patches the home is seen), or the home's submodule of that name."""

    def __getattr__(name: str):
        module = home.get(name)
        if module is None:
            raise AttributeError(f"module {door!r} has no attribute {name!r}")
        target = importlib.import_module(module)
        try:
            return getattr(target, name)
        except AttributeError:
            return importlib.import_module(f"{module}.{name}")

    return __getattr__
