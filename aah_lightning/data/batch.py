"""What a training batch holds, and its split into the model's inputs and the targets it predicts."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class Split(NamedTuple):
    inputs: Tensor  # [B, T] token ids the model reads
    targets: Tensor  # [B, T] the next token at each position
    doc_ids: Tensor | None  # [B, T] document of each input position (None without document ids)


def split_batch(batch: dict) -> Split:
    """A batch of packed ``T + 1`` blocks (``tokens``, optional ``doc_ids``: ``[B, T + 1]``) as inputs and targets."""
    tokens, docs = batch["tokens"], batch.get("doc_ids")
    return Split(tokens[:, :-1], tokens[:, 1:], None if docs is None else docs[:, :-1])


def seq_len_of(batch: dict) -> int:
    """The sequence length T the model sees in ``batch``."""
    return batch["tokens"].shape[1] - 1
