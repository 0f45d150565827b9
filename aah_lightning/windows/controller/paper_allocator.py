"""The ``paper`` allocator: the authors' window-selection procedure, for parity studies next to ``reach``.

**These networks are never trained.** In the authors' code the scorer and the joint sibling scorer receive no
gradient: their logits only feed an argmax, whose index picks a mask, so the loss never reaches them and AdamW skips
them (their weights stay bit-identical to the random initialisation). Here they are the same kind of thing on
purpose: seeded random weights (``model.aah.seed``), held by the policy as plain tensors outside the model, never
handed to the optimizer, used under ``no_grad``. The "learned" windows of the paper are therefore a fixed random
function of the heads' statistics; this allocator exists so that function can be run and compared, not because it
is a good way to choose windows (``reach`` is the project's default).

Procedure (the authors' code; docs/method.md), per layer, on the layer's hierarchy of head groups:

* Inputs per group at level l of an L-level hierarchy, 29 numbers ("enriched"): the group's 9 ``paper`` features
  X (mean of the heads below it), the level scalar l / max(1, L - 1), the parent difference X - X[parent] (zeros at
  the top), the global offset X - mean over the level's groups of X, and the size fraction (heads over heads at
  level 0, child groups over the level below's groups above it).
* Scorer 29 -> 16 -> K (GELU; K = number of candidate windows) gives each group K logits.
* Joint sibling scorer 116 -> 64 -> 2K on a pair (a, b) of consecutive siblings, input [u_a, u_b, u_a - u_b,
  u_b - u_a]; its two rows **replace** the logits of a and b. Top level: pairs (0, 1), (2, 3), ... over all groups;
  below: pairs inside each parent's children (ascending); an odd one out keeps its own logits.
* Window index = argmax (first maximum on ties), top-down; with the parent constraint a child's index is
  min(own argmax, parent's index).

Differences from the authors' code, all following from this project's controller: features come from the probe
(rho is the mass at distance 0, the entropy is normalised by the visible keys) and are EMA-smoothed; groups come from
average-linkage clustering, not the forced 2-way split, and levels are never pass-through copies; a parent's
features are the mean over all heads below it (the authors take the unweighted mean of the children). The networks
have the reference's shapes and PyTorch's default ``nn.Linear`` initialisation, but their values cannot match the
authors' (those depend on the exact RNG draw order of their model), so parity is in kind, not in the exact windows.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from aah_lightning.errors import ConfigError
from aah_lightning.windows.controller.allocators import LayerInputs

N_BASE = 9  # the paper feature family (features.FeatureLayout.paper)
N_INPUT = 3 * N_BASE + 2  # 29: features, level scalar, parent difference, global offset, size fraction
HIDDEN = 16
JOINT_HIDDEN = 64
# Offset of this allocator's generator from model.aah.seed (the probe uses seed, fixed_random grouping seed + 1).
SEED_OFFSET = 2
WEIGHT_NAMES = ("w1", "b1", "w2", "b2", "j1", "jb1", "j2", "jb2")


def _linear(out_f: int, in_f: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
    """PyTorch's default ``nn.Linear`` init (kaiming-uniform with a = sqrt(5)): U(-1/sqrt(in), 1/sqrt(in))."""
    bound = 1.0 / math.sqrt(in_f)
    w = (torch.rand(out_f, in_f, generator=g) * 2 - 1) * bound
    b = (torch.rand(out_f, generator=g) * 2 - 1) * bound
    return w, b


def init_layer(n_candidates: int, g: torch.Generator) -> dict[str, Tensor]:
    """One layer's scorer and joint sibling scorer weights, fp32, drawn from ``g``."""
    w1, b1 = _linear(HIDDEN, N_INPUT, g)
    w2, b2 = _linear(n_candidates, HIDDEN, g)
    j1, jb1 = _linear(JOINT_HIDDEN, 4 * N_INPUT, g)
    j2, jb2 = _linear(2 * n_candidates, JOINT_HIDDEN, g)
    return dict(w1=w1, b1=b1, w2=w2, b2=b2, j1=j1, jb1=jb1, j2=j2, jb2=jb2)


def _mlp(x: Tensor, w1: Tensor, b1: Tensor, w2: Tensor, b2: Tensor) -> Tensor:
    return F.linear(F.gelu(F.linear(x, w1.double(), b1.double())), w2.double(), b2.double())


class PaperAllocator:
    """The authors' untrained scorer and joint sibling scorer, one independent pair of networks per layer.

    ``joint``: use the joint sibling scorer (the paper's setting; the authors turned it off for grouping_off).
    """

    def __init__(self, n_layer: int, n_candidates: int, seed: int, joint: bool = True):
        g = torch.Generator().manual_seed(seed + SEED_OFFSET)
        self.n_candidates = n_candidates
        self.joint = joint
        self.layers = [init_layer(n_candidates, g) for _ in range(n_layer)]

    @classmethod
    def for_policy(cls, settings, n_layer: int, candidates: list[int], seed: int) -> PaperAllocator:
        return cls(n_layer, len(candidates), seed, joint=settings.paper_joint_scorer)

    # -- inputs --------------------------------------------------------------------------------------------------
    @staticmethod
    def level_features(inputs: LayerInputs) -> list[Tensor]:
        """Per level, the groups' 9 paper features ``[n_groups, 9]``: the mean over the heads below each group."""
        x = inputs.features[:, :N_BASE].to(torch.float64)
        return [torch.stack([x[g].mean(0) for g in level]) for level in inputs.hierarchy.levels]

    @staticmethod
    def enriched_inputs(inputs: LayerInputs) -> list[Tensor]:
        """Per level, the 29-number inputs ``[n_groups, 29]`` of every group."""
        h = inputs.hierarchy
        per_level = PaperAllocator.level_features(inputs)
        top = len(h.levels) - 1
        out = []
        for level, x in enumerate(per_level):
            n = x.shape[0]
            scalar = torch.full((n, 1), level / max(1, top), dtype=torch.float64)
            if level < top:
                parent_diff = x - per_level[level + 1][h.parents(level)]
            else:
                parent_diff = torch.zeros_like(x)
            offset = x - x.mean(0, keepdim=True)
            if level == 0:
                sizes = torch.tensor([len(g) for g in h.levels[0]], dtype=torch.float64)
            else:  # child groups under each group
                parents = h.parents(level - 1)
                sizes = torch.tensor([parents.count(p) for p in range(n)], dtype=torch.float64)
            out.append(torch.cat([x, scalar, parent_diff, offset, (sizes / sizes.sum()).view(n, 1)], dim=1))
        return out

    # -- scoring -------------------------------------------------------------------------------------------------
    def logits(self, layer: int, u: Tensor, pairs: list[tuple[int, int]]) -> Tensor:
        """``[n, K]`` logits of ``u`` ``[n, 29]``; each pair's rows replaced by the joint sibling scorer's."""
        w = self.layers[layer]
        z = _mlp(u, w["w1"], w["b1"], w["w2"], w["b2"])
        if self.joint:
            for a, b in pairs:
                pair_in = torch.cat([u[a], u[b], u[a] - u[b], u[b] - u[a]])
                z[[a, b]] = _mlp(pair_in, w["j1"], w["jb1"], w["j2"], w["jb2"]).view(2, self.n_candidates)
        return z

    @torch.no_grad()
    def __call__(self, inputs: LayerInputs) -> list[list[int]]:
        h = inputs.hierarchy
        u = self.enriched_inputs(inputs)
        top = len(h.levels) - 1
        chosen: list[list[int]] = [[] for _ in h.levels]
        n_top = len(h.levels[top])
        z = self.logits(inputs.layer, u[top], [(i, i + 1) for i in range(0, n_top - 1, 2)])
        chosen[top] = z.argmax(-1).tolist()
        for level in range(top - 1, -1, -1):
            parents = h.parents(level)
            pairs = []
            for p in range(len(h.levels[level + 1])):
                kids = [c for c, q in enumerate(parents) if q == p]
                pairs += [(kids[i], kids[i + 1]) for i in range(0, len(kids) - 1, 2)]
            raw = self.logits(inputs.layer, u[level], pairs).argmax(-1).tolist()
            if inputs.parent_constraint:
                raw = [min(r, chosen[level + 1][p]) for r, p in zip(raw, parents)]
            chosen[level] = raw
        return chosen

    # -- state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The weights as plain tensors (``torch.load(weights_only=True)`` reads them)."""
        return {"layers": [{k: v.clone() for k, v in layer.items()} for layer in self.layers]}

    def load_state_dict(self, state: dict) -> None:
        layers = state["layers"]
        if len(layers) != len(self.layers) or any(
            tuple(new[k].shape) != tuple(old[k].shape) for new, old in zip(layers, self.layers) for k in WEIGHT_NAMES
        ):
            raise ConfigError(
                "the checkpoint's paper-allocator weights do not fit this run: model.gpt.n_layer and the number of "
                "model.aah.candidates must match the checkpoint"
            )
        self.layers = [{k: layer[k].to(torch.float32).clone() for k in WEIGHT_NAMES} for layer in layers]
