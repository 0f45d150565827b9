"""The ``retrieval`` need signal's measurement: which heads copy a span back from far away, and from how far.

A trained language model that meets a span of text for the second time continues it by copying: a few heads look
back at the span's first occurrence and read the token that came next there. Those are the heads that need a long
window; the others serve nearer context and keep working within a window plus a sink. The signal builds that
situation from the batch itself, so it needs no prompt, no language and no tokenizer:

* probe ``i`` takes a sequence of the batch and overwrites its last ``m`` tokens with a copy of an earlier span of
  the same sequence, ``d_i`` tokens further back (``d_i`` stratified over the context: probe ``i`` of ``n`` draws it
  from the ``i``-th of ``n`` equal strata of the distances the sequence allows);
* one no-grad forward records every layer's q and k (the mass probe's ``Recording``); at each position of the copy
  (but its last), head ``h`` *hits* when its full-causal attention peaks exactly on the source token it should copy
  next, ``d_i - 1`` tokens back (the copy-paste criterion of retrieval-head studies, on argmax, so that a sink that
  takes most of a head's mass does not hide where the rest goes);
* the need of candidate ``W`` is the share of hits that ``W`` keeps: ``need_{l,h}(W) = mean_i hits_{l,h,i} *
  [d_i - 1 < W]`` (a head that copies from everywhere needs the whole context; one that never copies needs nothing
  beyond the nearest window), with the standard error of that mean over probes.

Cost: one no-grad forward of ``n`` sequences and ``L * H * (m - 1)`` query rows of full-causal scores, against
``L * H * (K - 1)`` forwards for the gain signal: a decision on a 30-layer model at T = 2048 takes minutes on a CPU,
not hours. It measures copying, not every use of context: a head that needs 300 tokens of nearby text for the
perplexity shows no hits. Use it with candidates whose narrowest is a working window (with a sink on a pretrained
model), so that the budget buys long windows for the copying heads and everything else stays usable.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aah_lightning import progress
from aah_lightning.model.attention import Recording
from aah_lightning.windows.probe import full_causal_probs


def copy_probes(tokens: Tensor, n_probes: int, span: int, generator: torch.Generator | None = None):
    """``n_probes`` copy probes from the rows of ``tokens`` ``[B, T]``: ``(probes [n, T], distance [n])``.

    Probe ``i`` is row ``i % B`` with its last ``span`` tokens replaced by the span that starts ``distance[i]``
    tokens before them; ``distance[i]`` is drawn uniformly from the ``i``-th of ``n`` equal strata of ``[span, T -
    span]`` (the copy never overlaps its source)."""
    B, T = tokens.shape
    if T < 2 * span + 1:
        raise ValueError(f"a copy probe of {span} tokens needs sequences of at least {2 * span + 1} tokens, got {T}")
    lo, hi = span, T - span  # the source starts at T - span - d >= 0 and ends before the copy begins
    edges = torch.linspace(lo, hi, n_probes + 1)
    u = torch.rand(n_probes, generator=generator)
    distance = (edges[:-1] + u * (edges[1:] - edges[:-1])).long().clamp(lo, hi)
    probes = tokens[torch.arange(n_probes) % B].clone()
    for i, d in enumerate(distance.tolist()):
        start = T - span - d
        probes[i, T - span :] = probes[i, start : start + span]
    return probes, distance


@torch.no_grad()
def retrieval_hits(q: Tensor, k: Tensor, span: int, distance: Tensor) -> Tensor:
    """Hit rate ``[n, H]`` of one layer's heads on the copy probes: ``q``, ``k`` ``[n, H, T, D]`` (keys expanded to
    the query heads). At copy position ``T - span + j`` (``j < span - 1``) the next token is the source's
    ``j + 1``-th, ``distance - 1`` tokens back; a head hits where its full-causal attention peaks there."""
    T = q.shape[2]
    queries = torch.arange(T - span, T - 1, device=q.device)
    hits = []
    for i, d in enumerate(distance.tolist()):
        probs = full_causal_probs(q[i : i + 1], k[i : i + 1], queries)[0]  # [H, span - 1, T]
        source = queries - (d - 1)
        hits.append((probs.argmax(-1) == source.view(1, -1)).double().mean(-1))
    return torch.stack(hits)


@torch.no_grad()
def run_retrieval_probe(
    model, tokens: Tensor, candidates: list[int], n_probes: int, span: int, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Need ``[L, H, K]`` and its squared standard error ``[L, H, K]`` (float64, CPU) from ``n_probes`` copy probes of
    ``span`` tokens, and the hit rates ``[n, L, H]`` they came from. The probes run at the table in force (full
    context at a retrofit's step 0): a head is judged by where it looks, not by what its window lets it see."""
    probes, distance = copy_probes(tokens, n_probes, span, generator)
    was_training = model.training
    shown = progress.current()  # the forward, then the full-causal scores of each layer
    try:
        model.eval()
        plans = [Recording(plan) for plan in model.attention_plans(probes.shape[1])]
        shown.set_total(1 + len(plans))
        model(probes, None, plans=plans)
        shown.advance()
    finally:
        model.train(was_training)
    layers = []
    for plan in plans:
        layers.append(retrieval_hits(*plan.records[0][:2], span, distance.to(probes.device)))
        shown.advance()
    hits = torch.stack(layers, dim=1).cpu()  # [n, L, H]
    reach = torch.tensor([[d - 1 < w for w in candidates] for d in distance.tolist()], dtype=torch.float64)  # [n, K]
    per_probe = hits.unsqueeze(-1) * reach.view(-1, 1, 1, len(candidates))  # [n, L, H, K]
    n = per_probe.shape[0]
    se2 = per_probe.var(dim=0, unbiased=True) / n if n > 1 else torch.zeros_like(per_probe[0])
    return per_probe.mean(0), se2, hits
