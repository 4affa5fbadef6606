"""benchmarks/peers/peers.py's own tooling: llama-perplexity's KL output parsed, runs folded into medians,
the KL-beside-speed table, the bound's active-byte count, and cold runs' page-cache drop checked.

The parser reads a real `llama-perplexity --kl-divergence` output (tests/fixtures/peers/, captured
from the llama.cpp build scripts/build_llama_cpp.sh makes, Q4_0 of the demo against its bf16);
the page-cache tests drop and measure real pages of a file on this filesystem (not tmpfs).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from benchmarks.peers import peers_quality, peers_report
from benchmarks.io.page_cache import cached_bytes, drop_pages, read_into_page_cache
from engine.synth.bpe_tokenizer import bytes_to_unicode

FIXTURES = Path(__file__).parent / "fixtures" / "peers"
# The fixture's summary lines, as printed (Q4_0 of the demo against its bf16, 8 chunks of 512).
FIX = {"kl_mean": 0.006429, "kl_mean_unc": 0.000020, "kl_median": 0.006327, "kl_max": 0.010481, "kl_p99": 0.008906,
       "top1": 64.853, "ppl_q": 39063.934194, "ppl_base": 39316.622232}


def test_parse_kld_reads_every_figure_of_a_real_run():
    r = peers_quality.parse_kld((FIXTURES / "llama_perplexity_kld.txt").read_text())
    # The fixture's own lines, converted: percentages become fractions, ± kept beside the means.
    assert (r["chunks"], r["ctx"]) == (8, 512)
    assert r["scored_tokens"] == 8 * 255
    assert r["kl_mean"] == pytest.approx(FIX["kl_mean"]) and r["kl_mean_unc"] == pytest.approx(FIX["kl_mean_unc"])
    assert r["kl_median"] == pytest.approx(FIX["kl_median"]) and r["kl_max"] == pytest.approx(FIX["kl_max"])
    assert r["kl_p99"] == pytest.approx(FIX["kl_p99"])
    assert r["top1_agreement"] == pytest.approx(FIX["top1"] / 100)
    assert r["ppl_model"] == pytest.approx(FIX["ppl_q"]) and r["ppl_reference"] == pytest.approx(FIX["ppl_base"])
    assert 0 <= r["kl_median"] <= r["kl_p99"] <= r["kl_max"]


def test_parse_kld_names_what_is_missing():
    text = (FIXTURES / "llama_perplexity_kld.txt").read_text()
    cut = text[:text.index("====== KL divergence statistics")]
    with pytest.raises(peers_quality.PerplexityOutputError, match="kl_mean.*top1_agreement"):
        peers_quality.parse_kld(cut)
    with pytest.raises(peers_quality.PerplexityOutputError, match="chunks"):
        peers_quality.parse_kld("main: error: failed to load model\n")


def test_parse_base_reads_chunks_and_context():
    r = peers_quality.parse_base("perplexity: calculating perplexity over 8 chunks, n_ctx=512, batch_size=512, n_seq=1")
    assert (r["chunks"], r["ctx"]) == (8, 512)
    with pytest.raises(peers_quality.PerplexityOutputError):
        peers_quality.parse_base("nothing here")


def _row(mode, quant, engine, run, tok_s, status="ok", **kw):
    return {"mode": mode, "quant": quant, "engine": engine, "run": run, "status": status, "decode_tok_s": tok_s,
            "ttft_s": 0.1, "load_s": 1.0, "wall_s": 5.0, "peak_bytes": 100 << 20, "limit_bytes": 1 << 30, **kw}


def test_runs_fold_into_median_and_range_and_ratios_use_the_medians():
    rows = [_row("resident", "int8", "ours", i, v) for i, v in enumerate((40.0, 44.0, 41.0), 1)]
    rows += [_row("resident", "int8", "llama-bench", i, v) for i, v in enumerate((80.0, 78.0, 90.0), 1)]
    rows.append(_row("resident", "int8", "llama-bench", 4, None, status="timeout"))
    summary = peers_report.summarize(rows)
    ours, theirs = summary
    assert ours["decode_tok_s"] == {"median": 41.0, "min": 40.0, "max": 44.0, "n": 3}
    assert theirs["runs"] == 4 and theirs["ok"] == 3 and theirs["status"] == "ok/timeout"
    assert theirs["decode_tok_s"]["median"] == 80.0
    table = peers_report.race_table(summary)
    assert "| resident | int8 | ours | 3/3 |" in table and "41.00 (40.00-44.00)" in table
    assert "| resident | Q8_0 | llama-bench | 3/4 ok/timeout |" in table  # the file llama.cpp ran
    assert peers_report.ratio_lines(summary, ["resident"]) == [
        "- resident int8: ours / llama-bench (Q8_0) decode = 0.512x (medians)"]


def test_quality_table_puts_kl_beside_speed():
    rows = [_row("resident", "int4-g32", "ours", 1, 45.0), _row("resident", "int4-g32", "llama-bench", 1, 90.0)]
    quality = [{"quant": "int4-g32", "theirs": "Q4_0",
                "ours": {"kl_mean": 0.0123, "kl_p99": 0.1, "top1_agreement": 0.95},
                "llama": {"kl_mean": 0.02, "kl_mean_unc": 0.001, "kl_p99": 0.2, "top1_agreement": 0.9}}]
    line = peers_report.quality_table(quality, peers_report.summarize(rows)).splitlines()[2]
    assert line == ("| int4-g32 | 0.012300 | 0.10000 | 95.00% | 45.0 | Q4_0 | 0.020000 ± 0.001000 | 0.20000 | "
                    "90.00% | 90.0 | 0.50x |")


def test_active_bytes_counts_k_of_e_experts_and_one_embedding_row(tmp_path):
    E, K, H, I, V = 4, 2, 8, 4, 16
    t = {"model.embed_tokens.weight": torch.zeros(V, H, dtype=torch.bfloat16),
         "lm_head.weight": torch.zeros(V, H, dtype=torch.bfloat16),
         "model.layers.0.self_attn.q_proj.weight": torch.zeros(H, H, dtype=torch.bfloat16),
         "model.layers.0.mlp.gate.weight": torch.zeros(E, H, dtype=torch.bfloat16)}
    for e in range(E):
        t[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = torch.zeros(H, I, dtype=torch.int8)
    save_file(t, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(
        f'{{"num_experts_per_tok": {K}, "num_experts": {E}, "vocab_size": {V}}}')
    a = peers_report.ours_active_bytes(tmp_path)
    assert a["expert_bytes"] == E * H * I and a["embedding_bytes"] == V * H * 2
    assert a["dense_bytes"] == (V * H + H * H + E * H) * 2
    assert a["active_bytes"] == a["dense_bytes"] + K * H * I + H * 2
    line = peers_report.bound_lines(1e9, 2, [("ours", "int8", a, 2e9 / a["active_bytes"] / 4)])[1]
    assert f"bound 1.0 GB/s / 0 MB = {1e9 / a['active_bytes']:.1f} tok/s" in line and "= 0.50 of it" in line


def test_cold_drop_empties_the_page_cache_and_reading_fills_it(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(os.urandom(4 << 20))
    read_into_page_cache([tmp_path])
    assert cached_bytes([f]) >= 3 << 20
    assert drop_pages([tmp_path]) == 4 << 20
    assert cached_bytes([f]) == 0


def test_kl_text_is_cut_past_the_tokens_at_a_line_end(tmp_path, tiny_tokenizer):
    about = peers_quality.write_text(tmp_path / "t.txt", tiny_tokenizer, 300)
    text = (tmp_path / "t.txt").read_text(encoding="utf-8")
    assert len(text) == about["chars"] and text.endswith("\n")
    assert len(tiny_tokenizer.encode(text).ids) >= 300 + 64
    assert peers_quality.same_prefix([1, 2, 3, 4], [1, 2, 9, 4], 4) == 2
    assert peers_quality.same_prefix([1, 2], [1, 2, 3], 3) == 2


@pytest.fixture(scope="module")
def tiny_tokenizer() -> Tokenizer:
    """synth's byte-level BPE without merges (one id per byte): no training, the same pre-tokenizer."""
    b2u = bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={b2u[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return tok
