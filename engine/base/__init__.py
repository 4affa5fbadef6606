"""The engine's foundations: errors a user can cause, the dtype table, EngineConfig (every knob),
durable files, the output guard (output_target: where a command may write), untrusted input files
(inputs), bounded JSON reading, progress lines, page alignment (O_DIRECT windows, aligned buffers),
the huge-page arena for resident weights (hugepages) and returning freed heap to the OS (heap).

Owns: what every other engine package needs and nothing that knows about models or files of weights.
May import: nothing of the project (only the standard library, torch, tomli/tomli_w, tqdm).
"""
