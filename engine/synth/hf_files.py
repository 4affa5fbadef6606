"""The Hugging Face side files of a synthetic model: config.json, generation_config.json and a
byte-level tokenizer (tokenizer.json + tokenizer_config.json).
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.synth.geometry import EOS_TOKEN, EOS_TOKEN_ID, MIN_VOCAB
from engine.synth.recipe import SYNTH_VERSION


def hf_config(g: dict, seed: int, skew: float) -> dict:
    """config.json as transformers' Qwen3MoeConfig writes it, readable by transformers 4.x and 5.x."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": None,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "head_dim": g["head_dim"],
        "hidden_act": "silu",
        "hidden_size": g["hidden_size"],
        "initializer_range": g["initializer_range"],
        "intermediate_size": g["intermediate_size"],
        "max_position_embeddings": g["max_position_embeddings"],
        "moe_intermediate_size": g["moe_intermediate_size"],
        "norm_topk_prob": bool(g["norm_topk_prob"]),
        "num_attention_heads": g["num_attention_heads"],
        "num_experts": g["num_experts"],          # transformers 4.x spelling
        "num_local_experts": g["num_experts"],    # transformers 5.x spelling
        "num_experts_per_tok": g["num_experts_per_tok"],
        "num_hidden_layers": g["num_hidden_layers"],
        "num_key_value_heads": g["num_key_value_heads"],
        "output_router_logits": False,
        "rms_norm_eps": g["rms_norm_eps"],
        "rope_theta": float(g["rope_theta"]),
        "rope_parameters": {"rope_theta": float(g["rope_theta"]), "rope_type": "default"},
        "rope_scaling": None,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "torch_dtype": g["dtype"],
        "dtype": g["dtype"],
        "vocab_size": g["vocab_size"],
        "colibri_synth": {
            "version": SYNTH_VERSION,
            "preset": g.get("name", "custom"),
            "seed": seed,
            "routing_skew": skew,
        },
    }


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def _filler_tokens(count: int) -> list[str]:
    """Pseudo-words (' ab', ' ac', ...) for ids past the byte tokens.

    Encoding never produces them (there are no merges), but a model that samples them still
    decodes to readable text instead of failing.
    """
    space = _bytes_to_unicode()[ord(" ")]
    letters = "abcdefghijklmnopqrstuvwxyz"
    out: list[str] = []
    length = 2
    while len(out) < count:
        for idx in range(len(letters) ** length):
            word = ""
            for _ in range(length):
                idx, r = divmod(idx, len(letters))
                word = letters[r] + word
            out.append(space + word)
            if len(out) == count:
                break
        length += 1
    return out


def build_tokenizer(vocab_size: int):
    """Byte-level BPE without merges: ids 0-255 are the bytes, 256 is <|endoftext|>, the rest fillers."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    b2u = _bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    vocab[EOS_TOKEN] = EOS_TOKEN_ID
    for i, tok in enumerate(_filler_tokens(vocab_size - MIN_VOCAB)):
        vocab[tok] = MIN_VOCAB + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
    return tok


def _write_tokenizer(dir_: Path, g: dict) -> None:
    from engine.safetensors_writer import write_json_atomic
    tok = build_tokenizer(g["vocab_size"])
    tmp = dir_ / f".tokenizer.json.tmp-{os.getpid()}"
    tok.save(str(tmp), pretty=False)
    os.replace(tmp, dir_ / "tokenizer.json")
    write_json_atomic(dir_ / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "bos_token": None,
        "pad_token": None,
        "unk_token": None,
        "model_max_length": g["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    })


def write_side_files(dir_: Path, g: dict, seed: int, skew: float) -> None:
    from engine.safetensors_writer import write_json_atomic
    write_json_atomic(dir_ / "config.json", hf_config(g, seed, skew))
    write_json_atomic(dir_ / "generation_config.json", {
        "bos_token_id": None, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": None, "do_sample": False,
    })
    _write_tokenizer(dir_, g)
