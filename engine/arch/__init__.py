"""Model code: ModelArgs, the architecture registry (registry.py: one `Architecture` record per
family in families/, with its config parsing, config.json rules, synth plan and oracle config;
args.py: the tensor names and shapes every record's ModelArgs implies),
the forward pass (gpt-fast style, our own torch code), its layers, rotary embeddings, MoE
dispatch, MLA, gpt-oss's attention and experts, and the routing rules.

Owns: the math of a forward pass and what each architecture is.
May import: engine.base, engine.native, engine.weights (weights as linear operators).
"""
