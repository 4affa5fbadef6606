"""Serving the engine: `colibri serve` (an OpenAI-compatible HTTP API on Starlette + uvicorn) and
`colibri chat` (a terminal conversation), both on one loaded model and one generation worker.

Owns: requests from people and their tools, decoded together up to max_batch, on a model that stays loaded.
May import: engine.api (the engine's front door) and tuner.
"""
