"""Model code: ModelArgs, the architecture registry (registry.py: one `Architecture` record per
family in families/, with its config parsing, config.json rules, tensor shapes and synth plan),
the forward pass (gpt-fast style, our own torch code), its layers, rotary embeddings, MoE
dispatch, MLA, gpt-oss's attention and experts, and the routing rules.

Owns: the math of a forward pass and what each architecture is.
May import: engine.base, engine.native, engine.format.quant (weights as linear operators).
"""
