"""The Engine's side of speculative decoding (engine/run/speculative.py): the verify pass, the
rollback of its rejected rows, and the MTP drafter's view of the rows the model computed
(engine/run/mtp_drafter.py). A mixin of engine/run/runtime.py's Engine, kept apart so that file stays
the Engine's loading and plain forward."""

from __future__ import annotations

import torch

from engine.arch import kv_rollback, prefill
from engine.base import heap
from engine.base.config import PREFILL_CHUNK
from engine.format import fp8_checkpoint
from engine.format.container import dense_quantized
from engine.movement.plan import prefill_tokens_per_pass


class Drafting:
    """Engine methods for speculative decoding; the Engine sets _verify_saved, _hidden, mtp."""

    def verify(self, tokens: list[int], start_pos: int) -> torch.Tensor:
        """fp32 logits [n, V] of n consecutive decode tokens at start_pos.. of the engine's cache (the
        last accepted token and the drafts after it): decode_rows over one cache, so each row has its
        solo decode step's bits and each routed expert is fetched once for the n rows. The ring slots
        the rows overwrite are saved first; `rollback` undoes the rows the caller rejects."""
        n = len(tokens)
        if start_pos + n > self.kv.ctx_size:
            raise ValueError(f"{start_pos + n} positions exceed ctx_size {self.kv.ctx_size}")
        self._verify_saved = kv_rollback.save(self.kv, start_pos, start_pos + n)
        return self.decode_rows(tokens, [start_pos + i for i in range(n)], [self.kv] * n)

    @property
    def max_verify_rows(self) -> int | None:
        """The most rows one verify may take and still be undone (a sliding layer's ring), or None."""
        return kv_rollback.max_rows(self.kv)

    def rollback(self, length: int) -> None:
        """After a verify: the cache holds positions 0..length-1 only (the rejected rows' K/V undone:
        ring slots restored, the rest rewritten before any query reads them; engine/arch/kv_rollback.py)."""
        saved, self._verify_saved = self._verify_saved, None
        if saved is not None:
            kv_rollback.restore(self.kv, saved, max(0, length - saved.start))
            if self.mtp is not None and self._hidden:  # the accepted rows, for the MTP layer
                kept = length - saved.start
                self.mtp.observe(self.kv_tokens[saved.start:length], saved.start, self._hidden.pop()[:kept])
        if self._hidden:
            self._hidden.clear()
        del self.kv_tokens[length:]

    def _forward_observed(self, t: torch.Tensor, start_pos: int) -> torch.Tensor:
        """forward's prefill or decode step with the MTP drafter on: the same logits (a decode step by
        the model's own decode route, native whole step included, a prompt layer-major), and the rows'
        final hidden states handed to the MTP layer's state (engine/run/mtp_drafter.py), which only
        keeps them until a draft asks."""
        hidden: list = []
        if t.shape[0] == 1:
            if not self.mtp.takes_pair():  # a plain step no draft reads the pair of (MtpState.skip_pairs)
                return self.model.forward(t, start_pos, self.kv)
            logits = self.model.forward(t, start_pos, self.kv, hidden=hidden)
        else:
            self.mtp.reset(start_pos)  # a prompt: a new sequence from here
            group = prefill_tokens_per_pass(self.kv.ctx_size, self.plan.prefill_group or t.shape[0])
            for begin in range(0, t.shape[0], group):
                logits = prefill.layer_major(self.model, t[begin:begin + group], start_pos + begin, self.kv,
                                             PREFILL_CHUNK, hidden=hidden)
                self.mtp.observe(t[begin:begin + group].tolist(), start_pos + begin, hidden.pop())
                heap.release_freed()
            return logits
        self.mtp.observe(t.tolist(), start_pos, hidden.pop())
        return logits

    def load_dense_tensors(self, names: list[str]) -> dict:
        """Resident tensors beyond the model's (the MTP layer's), each as the model's own would be
        loaded (quantized, FP8 kept or dequantized, or plain in the compute dtype)."""
        quantized = dense_quantized(self.checkpoint, self._container, names)
        fp8_kept, fp8_dequantized = fp8_checkpoint.dense_fp8(self.checkpoint, self.fp8, names)
        self.quantized_names = set(quantized) | set(fp8_kept)
        return {n: self._load_dense(n, self._container, quantized, fp8_kept, fp8_dequantized) for n in names}

    def draft_stats(self) -> dict:
        """Speculative decoding's counters since its reset (engine/run/spec_gate.py SpecStats): {} when off."""
        return self.speculator.stats.to_dict() if self.speculator is not None else {}

