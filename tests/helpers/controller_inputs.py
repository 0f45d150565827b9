"""Constructed controller inputs whose attention reach is known by design (shared by the controller tests)."""

from __future__ import annotations

import torch

from aah_lightning.checkpoint import FLAT_CONTROLLER_SETTINGS
from aah_lightning.windows.config import AAHConfig, ControllerConfig
from aah_lightning.windows.policy_base import make_policy
from aah_lightning.windows.probe import ProbeResult


def local_head(seq_len: int, reach: int) -> torch.Tensor:
    """``[T, T]`` probabilities: each query spreads its mass evenly over its ``reach`` closest keys (itself too)."""
    p = torch.zeros(seq_len, seq_len)
    for i in range(seq_len):
        lo = max(0, i - reach + 1)
        p[i, lo : i + 1] = 1.0 / (i + 1 - lo)
    return p


def distant_head(seq_len: int, distance: int) -> torch.Tensor:
    """All mass on the key ``distance`` back (on key 0 while the query is closer to the start than that)."""
    p = torch.zeros(seq_len, seq_len)
    for i in range(seq_len):
        p[i, max(0, i - distance)] = 1.0
    return p


def constructed_probe(layers: list[list[torch.Tensor]], n_seq: int = 2, head_dim: int = 8, seed: int = 0):
    """A probe whose full-causal probabilities are the given ``[T, T]`` head patterns (every query sampled).

    q, k, v are the same random tensors for every head, so heads differ only through their attention.
    """
    g = torch.Generator().manual_seed(seed)
    T = layers[0][0].shape[0]
    q, k, v, probs = [], [], [], []
    for heads in layers:
        H = len(heads)
        base = [torch.randn(n_seq, 1, T, head_dim, generator=g).expand(n_seq, H, T, head_dim) for _ in range(3)]
        q.append(base[0])
        k.append(base[1])
        v.append(base[2])
        probs.append(torch.stack(heads).unsqueeze(0).expand(n_seq, H, T, T).contiguous())
    return ProbeResult(torch.arange(T), q, k, v, probs)


def controller_settings(**settings) -> ControllerConfig:
    """``ControllerConfig`` from settings named as one flat list (``target_acr=0.3, warmup_steps=0``), each placed in
    its block (``budget.target_acr``, ``schedule.warmup_steps``): short test code, without the deprecation path that
    a flat config takes."""
    blocks: dict[str, dict] = {}
    for key, value in settings.items():
        block, name = FLAT_CONTROLLER_SETTINGS[key]
        blocks.setdefault(block, {})[name] = value
    return ControllerConfig(**blocks)


def adaptive(n_layer: int, n_head: int, seq_len: int, candidates, sink=0, **controller) -> AdaptivePolicy:  # noqa: F821
    settings = dict(warmup_steps=0, control_interval=1)
    settings.update(controller)
    cfg = AAHConfig(
        policy="adaptive", candidates=list(candidates), sink=sink, controller=controller_settings(**settings)
    )
    return make_policy(cfg, n_layer, n_head, seq_len)


def synthetic_features(policy, profiles: torch.Tensor, paper: torch.Tensor | None = None) -> torch.Tensor:
    """Packed features ``[L, H, F]`` with the given mass profiles ``[L, H, K]`` (log-distance derived from them)."""
    L, H, K = profiles.shape
    layout = policy.layout
    x = torch.zeros(L, H, layout.size, dtype=torch.float64)
    x[..., layout.paper] = 1.0 if paper is None else paper
    x[..., layout.profile] = profiles
    # mean log-distance grows with the mass that lies beyond each candidate
    x[..., layout.logdist] = (1 - profiles).sum(-1, keepdim=True)
    return x


def random_profiles(n_layer: int, n_head: int, n_cand: int, generator: torch.Generator) -> torch.Tensor:
    """Monotone mass profiles ending at 1 (the largest candidate is the whole context)."""
    steps = torch.rand(n_layer, n_head, n_cand, generator=generator, dtype=torch.float64) ** 3
    m = steps.cumsum(-1)
    return m / m[..., -1:]
