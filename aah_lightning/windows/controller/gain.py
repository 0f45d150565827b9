"""The ``gain`` need signal: how much the loss would fall if one head had another window, measured by running it.

The mass signal asks where a head's full-causal softmax puts its weight. A head that never had reach puts none far
back, so mass cannot show that it *would* use context, and a head that does use far context shows it only as a
share. The gain signal asks the loss instead: for head ``h`` of layer ``l`` and candidate ``W``,

    gain_{l,h}(W) = L(head h of layer l at W_0) - L(head h of layer l at W)      (nats; gain(W_0) = 0),

the training loss on the probe sequences with that one head's window changed and every other head as the table has
it. ``W_0``, the narrowest candidate, is a common reference, so that gains measured at different tables can be
smoothed together: the knapsack's choice does not depend on a per-head constant. The standard error is that of the
*move* from the head's window in force to ``W`` (the per-token loss differences of the two forwards, paired): it is
what the settle rule weighs a move against, and far smaller than the error of either loss alone.

Why measured and not first order. The first-order estimate ``-<dL/do_h, o_h(W) - o_h(W_0)>`` (the gradient of the
loss along the change of the head's output, as DuoAttention's gates see it) costs one backward, but on a constructed
copy task it put the loss rise of taking reach from the head that uses it at 0.01-0.07 nats where the real rise was
0.07-4.5 nats, and it vanishes as the loss saturates: a trained head that solves its targets has no gradient left.
The measured gain has neither problem.

Cost: ``L * H * (K - 1)`` no-grad forwards of ``probe_sequences`` sequences per decision (a head's window in force
needs no extra forward), each adding one head's dense ``T x T`` attention; 40 forwards of 2 x 256 tokens for the
recall model. At control steps only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from aah_lightning import progress
from aah_lightning.model import masks
from aah_lightning.windows.probe import ProbeResult, run_probe


def one_head_attention(q: Tensor, k: Tensor, v: Tensor, window: int, docs: Tensor | None, sink: int = 0) -> Tensor:
    """Causal softmax attention of one head (``[n, 1, T, D]``) within ``window`` and the model's ``sink`` (the mask of
    ``masks.window_mask_mod``, as every backend computes it), in fp32, in the input's dtype."""
    n, _, T, _ = q.shape
    row = torch.tensor([window], device=q.device)
    allowed = masks.dense_mask(masks.window_mask_mod(row, docs, sink), 1 if docs is None else n, 1, T, q.device)
    scores = q.float() @ k.float().transpose(-1, -2) * q.shape[-1] ** -0.5
    return (torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v.float()).to(q.dtype)


class OneHeadWindow:
    """A plan that runs its layer's own plan, then replaces head ``head``'s output with its attention at ``window``.

    ``eager``: the block runs as its class defines it. Heads stay in their natural order (no ``head_groups``). Under
    grouped-query attention only the query head's own window changes; its key/value head is read as it is."""

    eager = True
    head_groups = None

    def __init__(self, inner, head: int, window: int, docs: Tensor | None, sink: int = 0):
        self.inner, self.head, self.window, self.docs, self.sink = inner, head, window, docs, sink

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        y = self.inner(q, k, v).clone()
        h = slice(self.head, self.head + 1)
        kv = self.head // (q.shape[1] // k.shape[1])  # under grouped-query attention: the head's key/value head
        kv = slice(kv, kv + 1)
        y[:, h] = one_head_attention(q[:, h], k[:, kv], v[:, kv], self.window, self.docs, self.sink)
        return y


def _token_losses(model, tokens: Tensor, targets: Tensor, docs, plans) -> Tensor:
    logits = model(tokens, docs, plans=plans)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")


@torch.no_grad()
def run_gain_probe(
    model,
    tokens: Tensor,
    targets: Tensor,
    doc_ids: Tensor | None,
    loss_mask: Tensor | None,
    candidates: list[int],
    n_sequences: int = 2,
    n_queries: int = 64,
    generator: torch.Generator | None = None,
) -> tuple[ProbeResult, Tensor, Tensor]:
    """Gain of every candidate for every head, ``[L, H, K]`` float64 on CPU (0 at the narrowest), the squared standard
    error of moving each head from its window in force to each candidate (0 at its own window), and the mass probe
    of the same sequences (for the grouping features)."""
    probe = run_probe(model, tokens, doc_ids, n_sequences, n_queries, generator)
    tokens, targets = tokens[:n_sequences], targets[:n_sequences]
    docs = None if doc_ids is None else doc_ids[:n_sequences]
    counted = torch.ones_like(targets, dtype=torch.bool) if loss_mask is None else loss_mask[:n_sequences].bool()
    counted = counted.flatten()
    n_counted = max(int(counted.sum()), 1)
    T = tokens.shape[1]
    table = model.windows.tolist()
    was_training = model.training
    L, H, K = len(table), len(table[0]), len(candidates)
    gain = torch.zeros(L, H, K, dtype=torch.float64)
    se2 = torch.zeros(L, H, K, dtype=torch.float64)
    # One forward per (head, candidate) other than its window in force, and the base: the count the progress shows.
    shown = progress.current()
    shown.set_total(1 + sum(min(w, T) != min(row[h], T) for row in table for h in range(H) for w in candidates))
    try:
        model.eval()
        base = _token_losses(model, tokens, targets, docs, None)[counted].double()
        shown.advance()
        for layer in range(L):
            for head in range(H):
                losses = []
                for w in candidates:
                    if min(w, T) == min(table[layer][head], T):  # the head's window in force: the base forward
                        losses.append(base)
                        continue
                    plans = list(model.attention_plans(T, docs))
                    plans[layer] = OneHeadWindow(plans[layer], head, w, docs, getattr(model, "sink", 0))
                    losses.append(_token_losses(model, tokens, targets, docs, plans)[counted].double())
                    shown.advance()
                for j, lj in enumerate(losses):
                    gain[layer, head, j] = (losses[0] - lj).mean()
                    move = base - lj  # from the window in force to candidate j, token by token
                    se2[layer, head, j] = move.var(unbiased=True) / n_counted if n_counted > 1 else 0.0
    finally:
        model.train(was_training)
    return probe, gain, se2.nan_to_num(0.0)
