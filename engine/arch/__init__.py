"""Model code: ModelArgs, the architecture registry (registry.py: one `Architecture` record per
family in families/, with its config parsing, config.json rules, synth plan, oracle config and
how llama.cpp's GGUF files name it; args.py: the tensor names and shapes every record's ModelArgs
implies), the forward pass (gpt-fast style, our own torch code), its layers, rotary embeddings,
MoE dispatch, MLA, gpt-oss's attention and experts, and the routing rules. The weights it
multiplies by (plain tensors, int8/int4, FP8, MXFP4) are engine/weights' operators.

Owns: the math of a forward pass and what each architecture is.
May import: engine.base, engine.native, engine.weights (weights as linear operators); never
engine.format, which reads files into the records and operators defined here and below.
"""
