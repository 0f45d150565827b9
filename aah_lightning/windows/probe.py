"""The probe: what every head would attend to with the full causal context, on a few sequences.

At control and diagnostic steps only (never on the training hot path), a few sequences of the current batch go
through the current model under ``no_grad``: its own forward, with each layer's plan wrapped in a ``Recording``
(model/attention/recording.py), which keeps the layer's q, k (after RoPE) and v. For ``S`` sampled query positions
per sequence (stratified over the sequence) the full-causal softmax probabilities over all earlier keys are computed
in fp32, one layer at a time. Cost ``O(L * H * S * T * D)``, independent of batch size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from aah_lightning.model.attention import Recording


@dataclass
class ProbeResult:
    """Per layer: ``q, k, v`` ``[n, H, T, D]`` and ``probs`` ``[n, H, S, T]`` (zero beyond each query)."""

    queries: Tensor  # [S] sampled query positions, ascending
    q: list[Tensor]
    k: list[Tensor]
    v: list[Tensor]
    probs: list[Tensor]

    @property
    def seq_len(self) -> int:
        return self.k[0].shape[2]

    def distances(self) -> Tensor:
        """``[S, T]`` query-key distance ``q - kv`` (negative where the key is in the future)."""
        kv = torch.arange(self.seq_len, device=self.queries.device)
        return self.queries.view(-1, 1) - kv.view(1, -1)


def sample_queries(seq_len: int, n_queries: int, generator: torch.Generator | None = None) -> Tensor:
    """One position per stratum of ``[0, T)`` split into ``min(S, T)`` equal strata (random within the stratum)."""
    s = min(n_queries, seq_len)
    edges = torch.linspace(0, seq_len, s + 1)
    lo, hi = edges[:-1].floor().long(), edges[1:].floor().long().clamp(min=1)
    u = torch.rand(s, generator=generator)
    return torch.minimum(lo + (u * (hi - lo)).long(), hi - 1).clamp(min=0).unique()


def full_causal_probs(q: Tensor, k: Tensor, queries: Tensor) -> Tensor:
    """fp32 softmax of ``q[..., queries, :] @ k^T`` over keys ``kv <= query``: ``[n, H, S, T]``."""
    qs = q[:, :, queries].float()
    scores = qs @ k.float().transpose(-1, -2) * q.shape[-1] ** -0.5
    future = torch.arange(k.shape[2], device=k.device).view(1, -1) > queries.view(-1, 1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)


@torch.no_grad()
def run_probe(
    model,
    tokens: Tensor,
    doc_ids: Tensor | None = None,
    n_sequences: int = 2,
    n_queries: int = 64,
    generator: torch.Generator | None = None,
) -> ProbeResult:
    """Probe ``model`` (a ``GPT``) on the first ``n_sequences`` rows of ``tokens`` ``[B, T]``."""
    tokens = tokens[:n_sequences]
    docs = None if doc_ids is None else doc_ids[:n_sequences]
    was_training = model.training
    try:
        model.eval()
        plans = [Recording(plan) for plan in model.attention_plans(tokens.shape[1], docs)]
        model(tokens, docs, plans=plans)
    finally:
        model.train(was_training)
    queries = sample_queries(tokens.shape[1], n_queries, generator).to(tokens.device)
    q, k, v = (list(x) for x in zip(*(plan.records[0] for plan in plans)))
    probs = [full_causal_probs(ql, kl, queries) for ql, kl in zip(q, k)]
    return ProbeResult(queries, q, k, v, probs)


def mass_within(probe: ProbeResult, windows: Tensor) -> Tensor:
    """Share of each head's full-causal mass inside its window, averaged over sampled queries: ``[L, H]``.

    This is the attention-mass coverage (AMC) of a window table: 1.0 means the windows lose nothing the heads wanted.
    """
    dist = probe.distances()  # [S, T]
    out = []
    for layer, p in enumerate(probe.probs):
        w = windows[layer].to(dist.device).view(1, -1, 1, 1)
        inside = (dist >= 0) & (dist.view(1, 1, *dist.shape) < w)
        out.append((p * inside).sum(-1).mean(dim=(0, 2)))
    return torch.stack(out)
