"""Evaluation that shows what windows cost: the loss by position in the sequence, and models at other lengths.

* ``PositionLoss``: mean next-token loss per position bucket. Buckets are octaves, ``[0, 64)``, ``[64, 128)``,
  ``[128, 256)``, ... up to the sequence length (the last one ends there). A head with window W changes nothing for
  queries before position W, so a window's cost shows in the buckets from W on; evaluated at a longer sequence than
  trained, the buckets past the trained length show how a model extrapolates. Logged as
  ``val/loss_by_position/<first>-<last>`` (and ``test/...``), token-weighted, summed over ranks.
* ``RecallAccuracy``: on the recall task (``data/recall.py``), the share of answers whose most likely token is the
  right value, overall and by the distance to the answer in eighths of the sequence (``val/recall_acc``,
  ``val/recall_acc_by_distance/<a>-<b>``: answers that a window of ``b`` tokens reaches and one of ``a - 1`` does
  not), summed over ranks.
* ``BitsPerByte``: the loss in bits per byte of the text the predicted tokens encode (``val/bpb``, ``test/bpb``):
  comparable across tokenizers.
* ``widen_full_windows``: a checkpoint evaluated (or trained on) at a longer sequence than it was trained on. A head
  whose window was the whole trained context (W >= T) was trained to see everything, so it keeps the whole context
  at the new length; shorter windows keep their size, and RoPE is computed for any length.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torchmetrics import Metric

from aah_lightning.checkpoint import STATE_DICT_KEY, WINDOWS_STATE_KEY, gpt_settings, plain_key

FIRST_EDGE = 64  # the first bucket is [0, 64); then one bucket per octave
_SLOTS = 32  # buckets up to position 64 * 2**30: more than any sequence


def bucket_of(positions: Tensor) -> Tensor:
    """Bucket index of each position: 0 below ``FIRST_EDGE``, then 1 + the octave above it."""
    octave = torch.floor(torch.log2(positions.clamp(min=1).to(torch.float64) / FIRST_EDGE)).long() + 1
    return octave.clamp(min=0)


def bucket_range(index: int, seq_len: int) -> tuple[int, int]:
    """First and last position of bucket ``index`` in a sequence of ``seq_len`` tokens."""
    lo = 0 if index == 0 else FIRST_EDGE << (index - 1)
    return lo, min(FIRST_EDGE << index, seq_len) - 1


class PositionLoss(Metric):
    """Mean per-token loss in each position bucket, over every token seen (all ranks)."""

    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", torch.zeros(_SLOTS, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros(_SLOTS, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("length", torch.zeros((), dtype=torch.long), dist_reduce_fx="max")

    def update(self, token_losses: Tensor, mask: Tensor | None = None) -> None:
        """``token_losses``: ``[B, T]``, the loss of predicting the token after each position; ``mask`` ``[B, T]``:
        the targets that count (None: all)."""
        batch, seq_len = token_losses.shape
        index = bucket_of(torch.arange(seq_len, device=token_losses.device))
        weight = torch.ones_like(token_losses) if mask is None else mask.to(token_losses.dtype)
        self.total.index_add_(0, index, (token_losses.detach() * weight).sum(0).to(torch.float64))
        self.count.index_add_(0, index, weight.sum(0).to(torch.float64))
        self.length = torch.maximum(self.length, torch.tensor(seq_len, device=self.length.device))

    def compute(self) -> dict[str, Tensor]:
        """``{"<first>-<last>": mean loss}`` for every bucket that saw a token."""
        out = {}
        for i in torch.nonzero(self.count).flatten().tolist():
            lo, hi = bucket_range(i, int(self.length))
            out[f"{lo}-{hi}"] = (self.total[i] / self.count[i]).float()
        return out


class RecallAccuracy(Metric):
    """Accuracy of the recall answers, overall and per distance bucket ``(k * w, (k + 1) * w]`` of width
    ``w = seq_len / 8`` (buckets past the sequence, at a longer evaluation length, continue with the same width)."""

    full_state_update = False

    def __init__(self, seq_len: int, **kwargs):
        super().__init__(**kwargs)
        self.width = max(1, seq_len // 8)
        self.add_state("correct", torch.zeros(_SLOTS * 8, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.zeros(_SLOTS * 8, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, logits: Tensor, targets: Tensor, distance: Tensor) -> None:
        """``logits`` ``[B, T, V]``, ``targets`` ``[B, T]``; ``distance`` ``[B, T]``: 0 where a target is no answer."""
        answer = distance > 0
        if not answer.any():
            return
        hit = (logits[answer].argmax(-1) == targets[answer]).to(torch.float64)
        bucket = ((distance[answer] - 1) // self.width).clamp(max=len(self.count) - 1)
        self.correct.index_add_(0, bucket, hit)
        self.count.index_add_(0, bucket, torch.ones_like(hit))

    def compute(self) -> dict[str, Tensor]:
        """``{"all": accuracy, "<a>-<b>": accuracy of answers at distance a..b}`` for every bucket with answers."""
        out = {"all": (self.correct.sum() / self.count.sum()).float()}
        for i in torch.nonzero(self.count).flatten().tolist():
            out[f"{i * self.width + 1}-{(i + 1) * self.width}"] = (self.correct[i] / self.count[i]).float()
        return out


class BitsPerByte(Metric):
    """Cross-entropy in bits per byte of text: summed nats / (ln 2 x summed UTF-8 bytes the predicted tokens encode).

    Comparable across tokenizers. End-of-document tokens are predicted (their loss counts) but encode no text.
    """

    def __init__(self):
        super().__init__()
        self.add_state("nats", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("bytes", torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, mean_loss: torch.Tensor, n_tokens: int, n_bytes: torch.Tensor) -> None:
        self.nats += mean_loss.detach().double() * n_tokens
        self.bytes += n_bytes.sum()

    def compute(self) -> torch.Tensor:
        return self.nats / (math.log(2) * self.bytes)


def widen_full_windows(checkpoint: dict, seq_len: int) -> None:
    """In ``checkpoint`` (loaded for a model of sequence length ``seq_len``), give every head that saw the whole
    trained context the whole context at ``seq_len`` too, if that is longer."""
    trained = gpt_settings(checkpoint).get("seq_len")
    state = checkpoint.get(STATE_DICT_KEY)
    if not trained or seq_len <= trained or state is None:
        return
    for key, table in state.items():
        if plain_key(key) == WINDOWS_STATE_KEY:
            state[key] = torch.where(table >= trained, torch.full_like(table, seq_len), table)
