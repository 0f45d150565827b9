"""Need signals: what a head's need for each candidate window is measured by (``model.aah.controller.need``).

A signal is a class in ``SIGNALS`` with this contract (docs/controller.md, "Adding a mechanism"):

* ``__init__(settings, candidates, seq_len)``: its settings block (``NeedConfig``, ``model.aah.controller.need``);
* ``capped``: whether its need is a share of attention mass in [0, 1], so that ``coverage_target`` may cap a group's
  window; a signal that measures something else (a loss decrease) sets it False and the budget alone decides;
* ``measure(probe, model, tokens, targets, doc_ids, loss_mask)``: this step's measurement, the probe's packed
  features ``[L, H, F]`` (``features.FeatureLayout``) followed by any columns of its own, float64 on CPU and the same
  on every rank (``probe`` is the policy: ``probe.measure`` runs the mass probe and ``probe.rank_mean`` averages
  over ranks);
* ``need(x, smoothed_profiles)``: from this step's measurement ``x`` and the smoothed mass profiles ``[L, H, K]``,
  the need the allocation maximises ``[L, H, K]``, its standard error ``[L, H, K]`` (settling reads it) and whether
  it is capped; it may smooth its own columns across decisions;
* ``features(x)``: the probe's packed features without the signal's own columns;
* ``state_dict()`` / ``load_state_dict(state)``: what it smooths, as plain tensors (keys shared with the policy's
  checkpointed state, so keep them unique).

Deterministic CPU code: every rank gets the same rank-averaged measurement and so the same need.
"""

from __future__ import annotations

import torch
from torch import Tensor

from aah_lightning.plugins import find_plugin
from aah_lightning.windows.controller import features
from aah_lightning.windows.controller.gain import run_gain_probe
from aah_lightning.windows.controller.retrieval import run_retrieval_probe


def smooth(ema: Tensor | None, x: Tensor, alpha: float) -> Tensor:
    """``alpha * ema + (1 - alpha) * x``; ``x`` itself for the first value or with ``alpha`` 0."""
    return x.clone() if ema is None or alpha == 0 else alpha * ema + (1 - alpha) * x


class MassSignal:
    """``mass``: the share of a head's full-causal attention mass inside each window (the paper's statistics)."""

    capped = True

    def __init__(self, settings, candidates: list[int], seq_len: int):
        self.settings, self.candidates, self.seq_len = settings, candidates, seq_len
        self.layout = features.FeatureLayout(len(candidates))

    def measure(self, probe, model, tokens, targets, doc_ids, loss_mask) -> Tensor:
        return probe.measure(model, tokens, doc_ids)

    def features(self, x: Tensor) -> Tensor:
        return x

    def need(self, x: Tensor, smoothed_profiles: Tensor) -> tuple[Tensor, Tensor, bool]:
        return smoothed_profiles, profile_noise(x, self.layout), True

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class GainSignal(MassSignal):
    """``gain``: the loss decrease of giving one head a window, measured by running the probe sequences with that one
    head's window changed (``gain.py``); smoothed with the features' ``ema_alpha``, its variance with it."""

    capped = False  # a loss decrease, not a mass share: the budget alone limits reach

    def __init__(self, settings, candidates: list[int], seq_len: int):
        super().__init__(settings, candidates, seq_len)
        self.gain_ema: Tensor | None = None
        self.gain_se2_ema: Tensor | None = None

    def measure(self, probe, model, tokens, targets, doc_ids, loss_mask) -> Tensor:
        """The mass probe's packed features, then the gain ``[L, H, K]`` and its squared standard error ``[L, H, K]``
        (one no-grad forward per head and candidate), averaged over ranks."""
        c = self.settings  # NeedConfig
        result, gain, se2 = run_gain_probe(
            model,
            tokens,
            targets,
            doc_ids,
            loss_mask,
            self.candidates,
            n_sequences=c.probe_sequences,
            n_queries=c.probe_queries,
            generator=probe.probe_generator,
        )
        x = features.probe_features(result, self.candidates)
        k, f = len(self.candidates), x.shape[-1]
        return probe.rank_mean(torch.cat([x, gain.to(x), se2.to(x)], dim=-1), slice(f + k, f + 2 * k))

    def split(self, x: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Packed probe features, gain and its squared standard error (None, None where ``x`` carries no gain)."""
        k = len(self.candidates)
        if x.shape[-1] < self.layout.packed_size + 2 * k:
            return x, None, None
        f = x.shape[-1] - 2 * k
        return x[..., :f], x[..., f : f + k], x[..., f + k :]

    def features(self, x: Tensor) -> Tensor:
        return self.split(x)[0]

    def need(self, x: Tensor, smoothed_profiles: Tensor) -> tuple[Tensor, Tensor, bool]:
        x, gain, se2 = self.split(x)
        if gain is None:  # a measurement without gain columns (tests feed the mass features alone)
            return super().need(x, smoothed_profiles)
        a = self.settings.ema_alpha
        self.gain_ema = smooth(self.gain_ema, gain, a)
        # The variance of the smoothed estimate: probes are independent draws.
        se2 = se2.clamp_min(0)
        self.gain_se2_ema = (
            se2.clone() if self.gain_se2_ema is None or a == 0 else a * a * self.gain_se2_ema + (1 - a) ** 2 * se2
        )
        return self.gain_ema.clone(), self.gain_se2_ema.sqrt(), False

    def state_dict(self) -> dict:
        return {
            "gain_ema": None if self.gain_ema is None else self.gain_ema.clone(),
            "gain_se2_ema": None if self.gain_se2_ema is None else self.gain_se2_ema.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        gain, se2 = state.get("gain_ema"), state.get("gain_se2_ema")  # optional: older checkpoints have neither
        self.gain_ema = None if gain is None else gain.to(torch.float64).clone()
        self.gain_se2_ema = None if se2 is None else se2.to(torch.float64).clone()


class RetrievalSignal(GainSignal):
    """``retrieval``: the share of a head's copy-paste hits on copy probes built from the batch that each window keeps
    (``retrieval.py``): long windows go to the heads that copy from far back. One forward per decision; smoothed,
    with its variance, as the gain is."""

    def measure(self, probe, model, tokens, targets, doc_ids, loss_mask) -> Tensor:
        c = self.settings  # NeedConfig
        x = probe.measure(model, tokens, doc_ids)
        need, se2, _ = run_retrieval_probe(
            model, tokens, self.candidates, c.probe_sequences, c.copy_span, generator=probe.probe_generator
        )
        k, f = len(self.candidates), x.shape[-1]
        return probe.rank_mean(torch.cat([x, need.to(x), se2.to(x)], dim=-1), slice(f + k, f + 2 * k))


def profile_noise(x: Tensor, layout: features.FeatureLayout) -> Tensor:
    """Standard error ``[L, H, K]`` of this probe's mass profile (0 where ``x`` carries none, e.g. in tests)."""
    if x.shape[-1] < layout.packed_size:
        return torch.zeros(*x.shape[:-1], layout.n_candidates, dtype=torch.float64)
    return x[..., layout.profile_se2].clamp_min(0).sqrt()


# The signals by name. A new one is a module with a class of the contract above and one registry line,
# ``@register_signal("name")`` (docs/controller.md, "Adding a mechanism").
SIGNALS: dict[str, type] = {"mass": MassSignal, "gain": GainSignal, "retrieval": RetrievalSignal}


def register_signal(name: str):
    """Class decorator: make a need signal selectable as ``model.aah.controller.need.signal: name`` (or
    ``module:name`` for one in a module outside the package)."""

    def add(cls):
        if name in SIGNALS and SIGNALS[name] is not cls:
            raise ValueError(f"two need signals are registered as {name!r}: {SIGNALS[name]} and {cls}")
        SIGNALS[name] = cls
        return cls

    return add


def signal_class(name: str) -> type:
    """The signal ``model.aah.controller.need.signal`` names: a registered name, or ``module:name``."""
    return find_plugin(SIGNALS, name, "model.aah.controller.need.signal", "need signal")
