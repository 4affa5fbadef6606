"""The probe's user-facing errors: one line each, printed by the CLI."""

from engine.api import ColibriError


class ProfileError(ColibriError):
    """A hardware profile file is malformed, of another schema version, or lacks a figure."""


class ProbeError(ColibriError):
    """The probe cannot run here (directory not writable, too little space, fio failing)."""
