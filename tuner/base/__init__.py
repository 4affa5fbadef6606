"""What every tuner package shares, below all of them: typed JSON (a strict loader and JSON Schemas
from dataclasses, typed_json.py) and the text formatters every printer uses (text.py).

Owns: the mechanics of a schema and of a formatted figure, never a schema or a printer itself.
May import: engine.api (the engine's front door).
"""
