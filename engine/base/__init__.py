"""The engine's foundations: errors a user can cause, the dtype table, EngineConfig (every knob),
durable files, bounded JSON reading, progress lines and page alignment (O_DIRECT windows, aligned buffers).

Owns: what every other engine package needs and nothing that knows about models or files of weights.
May import: nothing of the project (only the standard library, torch, tomli/tomli_w, tqdm).
"""
