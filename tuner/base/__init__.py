"""What every tuner package shares, below all of them: typed JSON (a strict loader and JSON Schemas
from dataclasses, typed_json.py), the text formatters every printer uses (text.py), and the
Ctrl-C / `kill` that a long job may not lose (interrupts.py).

Owns: the mechanics of a schema, of a formatted figure and of a signal's delivery, never a schema,
a printer or what a job does when it stops.
May import: engine.api (the engine's front door).
"""
