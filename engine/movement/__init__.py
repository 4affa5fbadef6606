"""Data movement: the memory plan, the read pools (io/), expert caches (cache/), the slot arena, the
store contract and the streaming stores that read routed experts or whole layers from disk per use.

Owns: which bytes are where, and getting them there in time.
May import: engine.base, engine.weights, engine.format, engine.arch.
"""
