"""The Hugging Face side files of a synthetic model: config.json, generation_config.json and a
byte-level BPE tokenizer (tokenizer.json + tokenizer_config.json, trained by engine/synth/bpe_tokenizer.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.arch.registry import architecture
from engine.format.safetensors_writer import write_json_atomic
from engine.synth.bpe_tokenizer import EOS_TOKEN_ID, build_tokenizer, tokenizer_config
from engine.synth.recipe import SYNTH_VERSION


def hf_config(g: dict, seed: int, skew: float) -> dict:
    """config.json of a synthetic model, as transformers writes it for the geometry's architecture."""
    stamp = {"version": SYNTH_VERSION, "preset": g.get("name", "custom"), "seed": seed, "routing_skew": skew}
    return architecture(g["model_type"]).synth.config(g, EOS_TOKEN_ID, stamp)


def _write_tokenizer(dir_: Path, g: dict) -> None:
    tok = build_tokenizer(g["vocab_size"])
    tmp = dir_ / f".tokenizer.json.tmp-{os.getpid()}"
    tok.save(str(tmp), pretty=False)
    os.replace(tmp, dir_ / "tokenizer.json")
    write_json_atomic(dir_ / "tokenizer_config.json", tokenizer_config(g["max_position_embeddings"]))


def write_side_files(dir_: Path, g: dict, seed: int, skew: float) -> None:
    write_json_atomic(dir_ / "config.json", hf_config(g, seed, skew))
    write_json_atomic(dir_ / "generation_config.json", {
        "bos_token_id": None, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": None, "do_sample": False,
    })
    _write_tokenizer(dir_, g)
