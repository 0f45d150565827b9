"""The contract of a window policy (the registry that finds one by name is ``registry.py``, its names offered here).

A policy is one class, registered with ``@register("name")``; ``model.aah.policy: name`` selects it. The
LightningModule builds it with ``(cfg, n_layer, n_head, seq_len)``, asks it for the initial ``[n_layer, n_head]``
table, and before every optimizer step calls ``on_train_step``, which returns a new table or None; a policy whose ``rewind_step`` is a step has the run go back to
its initial weights right after its decision at that step (calibrate-and-rewind). Decisions must be
identical on every rank: a policy may depend on its settings, the step, its own seeded generators and the model (a
rank-averaged probe), never on rank-local randomness. Everything it needs to continue exactly after a resume goes
through ``state_dict`` (plain tensors, lists and ints: checkpoints load with ``torch.load(weights_only=True)``).

A policy checks its own settings in the classmethod ``validate`` (one ``ConfigError`` line naming the setting),
before anything is built, and says which of ``model.aah``'s policy settings it reads (``READS``; the others get one
warning line, never a refusal), and tells diagnostics what it decided through ``report()`` (a ``PolicyReport``), which
``report_from_state`` rebuilds from a checkpoint's ``state_dict``.

Built-in policies live in the modules of ``BUILTIN_MODULES``, imported the first time a name is looked up. A policy
outside this package is one importable module: ``model.aah.policy: my_module:name`` imports ``my_module`` (whose
``@register("name")`` runs on import) and uses ``name``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from aah_lightning.windows.config import AAHConfig
from aah_lightning.windows.groups import GroupTree
from aah_lightning.windows.registry import BUILTIN_MODULES, POLICIES, available_policies, policy_class, register

__all__ = [  # the registry's names are part of the contract a policy is written against
    "BUILTIN_MODULES",
    "POLICIES",
    "PolicyReport",
    "WindowPolicy",
    "available_policies",
    "make_policy",
    "policy_class",
    "register",
]


@dataclass
class PolicyReport:
    """What a policy decided, as diagnostics read it (CPU, plain Python, identical on every rank).

    candidates: the windows the policy chooses from (window fractions are reported for each).
    last_step: optimizer step of the last decision; None before the first or for a policy that never decides.
    trees: per layer, the hierarchy of head groups with each group's window (None for a layer without one); None
        for a policy that does not group heads.
    need: what decided the windows: per head and candidate, the smoothed need signal at the last decision (mass
        share kept, or the gain signal's loss decrease in nats); None for a policy that measures nothing.
    """

    candidates: list[int] = field(default_factory=list)
    last_step: int | None = None
    trees: list[GroupTree | None] | None = None
    need: Tensor | None = (
        None  # [L, H, K] float64: the need signal of each head for each candidate at the last decision
    )
    need_signal: str = "mass"  # what ``need`` measures: ``mass`` (share of attention mass) or ``gain`` (nats)


class WindowPolicy:
    """Base class: every head sees the whole causal context and nothing ever changes (override what differs)."""

    name = "base"
    # The settings of ``config.POLICY_SETTINGS`` this policy reads; the others it ignores (a warning, never a
    # refusal). None: the policy does not say (nothing is reported as unused, every setting is checked).
    READS: frozenset[str] | None = None

    @classmethod
    def reads(cls, cfg: AAHConfig) -> frozenset[str] | None:
        """Which settings of ``config.POLICY_SETTINGS`` this policy reads under ``cfg`` (``READS``)."""
        return cls.READS

    def __init__(self, cfg: AAHConfig, n_layer: int, n_head: int, seq_len: int):
        self.cfg = cfg
        self.n_layer, self.n_head, self.seq_len = n_layer, n_head, seq_len
        self.candidates = cfg.resolved_candidates(seq_len)

    @classmethod
    def validate(cls, cfg: AAHConfig, seq_len: int, n_layer: int, n_head: int) -> None:
        """Check this policy's own settings (the shared ones are checked by ``AAHConfig.validate``)."""

    def initial_table(self) -> Tensor:
        return torch.full((self.n_layer, self.n_head), self.seq_len, dtype=torch.int32)

    def on_train_step(self, step: int, model, batch) -> Tensor | None:
        """Called before training step ``step`` (0-based optimizer steps). Return a new table to apply, or None."""
        return None

    def rewind_step(self) -> int | None:
        """The step at which the run goes back to its initial weights and optimizer state, keeping the table the
        policy set at that step (calibrate-and-rewind, ``lit/rewind.py``); None: never. Fixed by the settings."""
        return None

    def report(self) -> PolicyReport:
        """What diagnostics show of this policy's decisions."""
        return PolicyReport(candidates=list(self.candidates))

    @classmethod
    def report_from_state(cls, state: dict, candidates: list[int]) -> PolicyReport:
        """``report()`` of a policy that saved ``state`` (a checkpoint's ``aah_policy``), without building one."""
        return PolicyReport(candidates=list(candidates))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def make_policy(cfg: AAHConfig, n_layer: int, n_head: int, seq_len: int) -> WindowPolicy:
    """The policy ``cfg.policy`` names, its settings checked first."""
    cfg.validate(seq_len, n_layer, n_head)
    return policy_class(cfg.policy)(cfg, n_layer, n_head, seq_len)
