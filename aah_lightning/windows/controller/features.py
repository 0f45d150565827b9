"""Per-head features from one probe, and their standardisation for grouping.

All features of all layers are packed into one ``[L, H, F]`` tensor so that a control step needs one all-reduce
and one device-to-host copy. Column layout (``FeatureLayout``):

* ``paper`` (9): mean|q|, std q, mean|k|, std k, mean|v|, std v (over sequences, time and channels of the head),
  e = entropy of the full-causal probabilities divided by ln(number of visible keys), n = mean L2 norm of the head's
  full-causal output, rho = mean mass on the key at distance 0. (The reference's rho, mass on the *last* key, is
  about 1e-5 under causality and carries no signal; the query's own key is the meaningful version.)
* ``profile`` (K): m(c) = share of the mass within distance < c, for every candidate c (the attention-mass coverage
  a window c would have). The reach allocator reads these.
* ``logdist`` (1): mean log(1 + distance) under the head's probabilities.
* ``profile_se2`` (K): the squared standard error of each ``profile`` entry (the variance of a sampled query's mass
  within c, divided by the number of sampled queries). Only the settling rule reads it (how much of a gain in kept
  mass is probe noise); it is not smoothed or stored, so ``size`` counts the columns before it.

The ``reach`` feature set is profile (candidates shorter than the probe, the others are 1 for every head) plus
logdist; ``all`` is paper plus reach, each family weighted equally.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from aah_lightning.windows.probe import ProbeResult

# The nine paper features, in order: mean_abs_q, std_q, mean_abs_k, std_k, mean_abs_v, std_v, entropy, out_norm, rho.


@dataclass(frozen=True)
class FeatureLayout:
    """Where each family sits in the packed feature vector, for ``n_candidates`` windows."""

    n_candidates: int

    @property
    def paper(self) -> slice:
        return slice(0, 9)

    @property
    def profile(self) -> slice:
        return slice(9, 9 + self.n_candidates)

    @property
    def logdist(self) -> slice:
        return slice(9 + self.n_candidates, 10 + self.n_candidates)

    @property
    def size(self) -> int:
        """Columns of the smoothed features (the policy's EMA state)."""
        return 10 + self.n_candidates

    @property
    def profile_se2(self) -> slice:
        return slice(self.size, self.size + self.n_candidates)

    @property
    def packed_size(self) -> int:
        """Columns a probe delivers: the features and ``profile_se2``."""
        return self.size + self.n_candidates


@torch.no_grad()
def layer_features(q: Tensor, k: Tensor, v: Tensor, probs: Tensor, queries: Tensor, candidates: list[int]) -> Tensor:
    """Features of one layer's heads: ``[H, 9 + K + 1 + K]`` fp32 on the probe's device (``FeatureLayout``).

    q, k, v: ``[n, H, T, D]``; probs: ``[n, H, S, T]`` full-causal probabilities of the sampled ``queries`` ``[S]``.
    """
    n, H, S, T = probs.shape
    stats = []
    for x in (q, k, v):
        x = x.float().transpose(0, 1).reshape(H, -1)
        stats += [x.abs().mean(1), x.std(1)]

    dist = queries.view(-1, 1) - torch.arange(T, device=probs.device).view(1, -1)  # [S, T]
    visible = (queries + 1).to(torch.float32)  # keys a query sees under full causality
    entropy = -torch.special.xlogy(probs, probs).sum(-1)  # [n, H, S]
    has_choice = visible > 1  # a query with one visible key has no entropy to normalise
    norm_ent = entropy[..., has_choice] / visible[has_choice].log()
    e = norm_ent.mean(dim=(0, 2)) if has_choice.any() else torch.zeros(H, device=probs.device)
    out = probs @ v.float()  # [n, H, S, D]: the head's full-causal output at the sampled queries
    out_norm = out.norm(dim=-1).mean(dim=(0, 2))
    rho = probs.gather(-1, queries.view(1, 1, -1, 1).expand(n, H, S, 1)).squeeze(-1).mean(dim=(0, 2))

    within = torch.stack([(dist >= 0) & (dist < c) for c in candidates]).to(probs.dtype)  # [K, S, T]
    per_query = torch.einsum("nhst,kst->hkns", probs, within).reshape(H, len(candidates), n * S)
    profile = per_query.mean(-1)
    se2 = per_query.var(-1, unbiased=n * S > 1) / (n * S)
    logd = torch.log1p(dist.clamp(min=0).to(probs.dtype))
    logdist = (probs * logd).sum(-1).mean(dim=(0, 2))
    paper = torch.stack(stats + [e, out_norm, rho], dim=1)
    return torch.cat([paper, profile, logdist.view(H, 1), se2], dim=1)


def probe_features(probe: ProbeResult, candidates: list[int]) -> Tensor:
    """Features of every layer: ``[L, H, F]`` fp32 on the probe's device (see ``FeatureLayout``)."""
    return torch.stack(
        [
            layer_features(q, k, v, p, probe.queries, candidates)
            for q, k, v, p in zip(probe.q, probe.k, probe.v, probe.probs)
        ]
    )


def clustering_matrix(features: Tensor, feature_set: str, candidates: list[int], seq_len: int, floor: float) -> Tensor:
    """Standardised features of one layer's heads, ``[H, F']`` float64, weighted so that ``||a - b||`` is the RMS
    difference per feature (averaged per family for ``all``, so the 9 paper statistics do not outvote reach).

    Each feature is z-scored across the layer's heads: the reference compared raw, all-positive statistics whose
    cosines are all about 0.999, so every layer collapsed to one forced split. The divisor is at least
    ``floor * mean|x|``: a spread below that is treated as noise rather than stretched to unit variance.
    """
    layout = FeatureLayout(len(candidates))
    short = [i for i, c in enumerate(candidates) if c < seq_len]  # m(c) of a window >= T is 1 for every head
    reach_cols = [layout.profile.start + i for i in short] + [layout.logdist.start]
    families = []
    if feature_set in ("paper", "all"):
        families.append(list(range(layout.paper.start, layout.paper.stop)))
    if feature_set in ("reach", "all"):
        families.append(reach_cols)
    parts = []
    for cols in families:
        x = features[:, cols].to(torch.float64)
        mean = x.mean(0, keepdim=True)
        scale = torch.maximum(x.std(0, unbiased=False, keepdim=True), floor * mean.abs()).clamp_min(1e-12)
        parts.append((x - mean) / scale / math.sqrt(len(families) * len(cols)))
    return torch.cat(parts, dim=1)
