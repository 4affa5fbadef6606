"""Parameter counts of any geometry by role, from its config.json-like keys: arithmetic only,
nothing allocated, so it can bound a geometry's size before anything else looks at it."""

from __future__ import annotations

from engine.base.errors import ConfigError


def param_counts(geometry: dict) -> dict:
    """Parameter counts by role, for qwen3_moe, mixtral, olmoe, deepseek_v3, glm4_moe, glm_moe_dsa and gpt_oss.

    Returns total, active (per token), routed_expert (one expert), routed_total, dense (everything
    that is not a routed expert: the part a streaming engine keeps resident), num_moe_layers,
    num_experts, top_k. Multi-token-prediction layers are not counted (inference skips them).
    """
    g = geometry
    mt = g.get("model_type")
    H, L, V = g["hidden_size"], g["num_hidden_layers"], g["vocab_size"]
    E = g.get("num_experts") or g.get("n_routed_experts") or g.get("num_local_experts")
    k = g["num_experts_per_tok"]
    if not E:
        raise ConfigError(f"{g.get('name', mt)}: geometry has no expert count")
    nh = g["num_attention_heads"]
    if mt in ("deepseek_v3", "glm_moe_dsa"):
        qk_head = g["qk_nope_head_dim"] + g["qk_rope_head_dim"]
        qr, kvr = g.get("q_lora_rank"), g["kv_lora_rank"]
        q = (H * qr + qr + qr * nh * qk_head) if qr else H * nh * qk_head
        kv = H * (kvr + g["qk_rope_head_dim"]) + kvr + kvr * nh * (g["qk_nope_head_dim"] + g["v_head_dim"])
        attn = q + kv + nh * g["v_head_dim"] * H
        if mt == "glm_moe_dsa":  # DSA lightning indexer
            ih, idim = g["index_n_heads"], g["index_head_dim"]
            attn += (qr or H) * ih * idim + H * idim + 2 * idim + H * ih
        moe_i = g["moe_intermediate_size"]
        dense_layers = g.get("first_k_dense_replace", 0)
        shared = g.get("n_shared_experts", 0) or 0
        router = E * H + E  # + e_score_correction_bias
    else:
        hd = g.get("head_dim") or H // nh
        nkv = g.get("num_key_value_heads", nh)
        attn = H * nh * hd + 2 * H * nkv * hd + nh * hd * H
        if mt == "qwen3_moe" or (mt == "glm4_moe" and g.get("use_qk_norm")):
            attn += 2 * hd
        elif mt == "olmoe":
            attn += H + nkv * hd
        if mt == "gpt_oss" or (mt == "glm4_moe" and g.get("attention_bias")):
            attn += nh * hd + 2 * nkv * hd
        if mt == "gpt_oss":
            attn += H + nh  # o_proj bias, attention sinks
        moe_i = g["moe_intermediate_size"] if mt in ("qwen3_moe", "glm4_moe") else g["intermediate_size"]
        dense_layers, shared, router = 0, 0, E * H
        if mt == "glm4_moe":
            dense_layers, shared, router = g.get("first_k_dense_replace", 1), g.get("n_shared_experts", 1), E * H + E
        elif mt == "gpt_oss":
            router = E * H + E
    expert = 3 * H * moe_i + (2 * moe_i + H if mt == "gpt_oss" else 0)  # gpt_oss experts carry biases
    moe_layers = L - dense_layers
    norms = 2 * H
    dense_mlp = 3 * H * g.get("intermediate_size", 0)
    embed = V * H * (1 if g.get("tie_word_embeddings") else 2)
    resident = (embed + H + L * (attn + norms) + dense_layers * dense_mlp
                + moe_layers * (router + shared * expert))
    routed_total = moe_layers * E * expert
    return {
        "total": resident + routed_total,
        "active": resident + moe_layers * k * expert,
        "routed_expert": expert,
        "routed_total": routed_total,
        "dense": resident,
        "num_moe_layers": moe_layers,
        "num_experts": E,
        "top_k": k,
    }
