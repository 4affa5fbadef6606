"""colibri: the entry points people and programs use, above the engine and the tuner.

cli (the `colibri` command), commands/ (one module per command group, thin over engine and tuner),
serve/ (`colibri serve`'s OpenAI-compatible HTTP server and `colibri chat`). Neither engine/ nor
tuner/ imports this package.
"""

__version__ = "0.1.0"
