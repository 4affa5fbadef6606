"""One module per architecture (or a family of sibling model_types): its `Architecture` record
(engine/arch/architecture.py) with the config parsing, validation rules, synth recipe, the
transformers oracle's tiny config and the names llama.cpp's GGUF files give it, built on the
shared pieces here (dense.py's llama layout, routed.py's sigmoid-routed MoE, synth_plans.py's
layer skeleton). engine/arch/registry.py lists every record once; tensor names and shapes follow
from the parsed ModelArgs (engine/arch/args.py).

May import: engine.base, engine.native, engine.weights and the rest of engine.arch.
"""
