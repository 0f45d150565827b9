"""The ``adaptive`` window policy: the AAH controller (docs/method.md, docs/controller.md).

At a control step (never between them): probe a few sequences of the current batch, compute per-head features,
average them over ranks, smooth them (EMA), and then, per layer and on CPU: standardise, group the heads, build the
hierarchy, allocate one window per group top-down and write the heads' windows into a new table. Every rank runs the
same deterministic code on the same averaged features, so every rank ends the step with the identical table.

State after a decision (all plain Python / CPU tensors, rank-identical; diagnostics read it through ``report()``):
    ``last_step``            step of the last decision (None before the first);
    ``hierarchies[l]``       ``Hierarchy`` of layer l (``levels[level][group]`` = head indices);
    ``group_windows[l]``     ``[level][group]`` window chosen for each group of layer l;
    ``last_coverage``        ``[L, H]`` share of each head's full-causal mass inside its new window on the last probe
                             (the attention-mass coverage, AMC), or None.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from aah_lightning.data.batch import split_batch
from aah_lightning.errors import ConfigError, require
from aah_lightning.progress import stage
from aah_lightning.windows.config import AAHConfig
from aah_lightning.windows.controller import features, reach, settling
from aah_lightning.windows.controller.allocators import LayerInputs
from aah_lightning.windows.controller.budget import allocate_within_budget
from aah_lightning.windows.controller.ceiling import Budget
from aah_lightning.windows.controller.grouping import Grouper, pairwise_distances
from aah_lightning.windows.controller.hierarchy import build_hierarchy
from aah_lightning.windows.controller.registry import ALLOCATORS, make_allocator
from aah_lightning.windows.controller.signals import signal_class, smooth
from aah_lightning.windows.groups import GroupTree, Hierarchy
from aah_lightning.windows.policy_base import PolicyReport, WindowPolicy, register
from aah_lightning.windows.probe import run_probe


@register("adaptive")
class AdaptivePolicy(WindowPolicy):
    """Windows chosen from head statistics through a hierarchy of head groups (settings: ``ControllerConfig``).

    It wires the controller's parts, each in its own module: the need signal (``signals.py``), grouping
    (``grouping.py``, ``hierarchy.py``), reach first and kept reach (``reach.py``), the budget and its ceiling
    (``ceiling.py``, ``budget.py``), the allocators without a budget (``registry.py``) and settling
    (``settling.py``)."""

    READS = frozenset({"candidates", "controller"})

    def __init__(self, cfg: AAHConfig, n_layer: int, n_head: int, seq_len: int):
        super().__init__(cfg, n_layer, n_head, seq_len)
        self.settings = c = cfg.controller
        self.layout = features.FeatureLayout(len(self.candidates))
        self.allocator = make_allocator(c.allocation, n_layer, self.candidates, cfg.seed)
        self.signal = signal_class(c.need.signal)(c.need, self.candidates, seq_len)
        self.budget = Budget(c.budget, self.candidates, seq_len, n_layer, cfg.sink)
        self.reach_first = reach.ReachFirst(c.reach, self.candidates, n_layer, n_head, self.budget.table_cost)
        self.grouper = Grouper(c.groups, n_layer, n_head, cfg.seed + 1)
        # Level l of the hierarchy is cut at threshold * growth**l.
        g = c.groups
        self.thresholds = [g.threshold * g.threshold_growth**lvl for lvl in range(g.depth)]
        # Controller state (all of it in state_dict).
        self.probe_generator = torch.Generator().manual_seed(cfg.seed)
        self.ema: Tensor | None = None  # [L, H, F] float64
        self.hierarchies: list[Hierarchy | None] = [None] * n_layer
        self.group_windows: list[list[list[int]] | None] = [None] * n_layer
        self.table: Tensor | None = None  # int32 [L, H], the last decided table
        self.last_step: int | None = None
        self.decisions = 0
        self.last_coverage: Tensor | None = None
        self.last_need: Tensor | None = None  # the need signal that decided the last table ([L, H, K])
        self.budget.start(self.initial_table())

    @classmethod
    def validate(cls, cfg: AAHConfig, seq_len: int, n_layer: int, n_head: int) -> None:
        c, candidates = cfg.controller, cfg.resolved_candidates(seq_len)
        require(  # the registry is the controller's own: the settings' dataclass does not know it
            c.allocation.allocator in ALLOCATORS,
            "model.aah.controller.allocation.allocator",
            c.allocation.allocator,
            f"one of {', '.join(sorted(ALLOCATORS))}",
        )
        signal = signal_class(c.need.signal)  # a registered name or module:name, else one error line
        c.validate(candidates, seq_len, n_head, cfg.sink)
        target = c.budget.target()
        require(  # a need that is not a mass share has no coverage target to stop at: only a budget limits reach
            signal.capped or target is not None,
            "model.aah.controller.need.signal",
            c.need.signal,
            "only with a budget (target_acr or target_causal_coverage): without one nothing limits reach",
        )
        if c.reach.heads and target is not None:  # the kept reach must fit the target beside the narrowest rest
            costs = Budget(c.budget, candidates, seq_len, n_layer, cfg.sink).costs
            unit = n_head * (n_layer if c.budget.scope == "model" else 1)
            reach.check_kept_reach_fits(c.reach, target[1], candidates, costs, unit)

    @property
    def partitions(self) -> list:
        return self.grouper.partitions

    @property
    def gain_ema(self) -> Tensor | None:
        return getattr(self.signal, "gain_ema", None)

    def initial_table(self) -> Tensor:
        """Full context until the first decision; with explorers (reach first), the explorer table from step 0."""
        if not self.reach_first.on:
            return super().initial_table()
        if self.settings.reach.formation_fill == "even":
            return self.reach_first.table(self.reach_first.even_fill(self.budget.target[1]))
        return self.reach_first.table()

    # -- schedule ----------------------------------------------------------------------------------------------------
    def is_control_step(self, step: int) -> bool:
        return self.settings.schedule.is_control_step(step)

    def rewind_step(self) -> int | None:
        """Calibrate-and-rewind: the first decision, at the end of the full-context warmup."""
        schedule = self.settings.schedule
        return schedule.warmup_steps if schedule.rewind else None

    def on_train_step(self, step: int, model, batch) -> Tensor | None:
        if not self.is_control_step(step) or self.last_step == step:
            return None
        tokens, targets, docs = split_batch(batch)
        previous = self.table
        # A decision on a large model takes minutes (the gain signal runs L x H x (K - 1) forwards): shown as it goes.
        with stage(f"windows at step {step}: measuring ({self.settings.need.signal} signal)", unit="fwd"):
            measured = self.signal.measure(self, model, tokens, targets, docs, batch.get("loss_mask"))
            table = self.decide(measured, step)
        return None if previous is not None and torch.equal(previous, table) else table

    # -- measuring ---------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def measure(self, model, tokens: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        """Probe ``model`` on ``tokens`` ``[B, T]``: packed features ``[L, H, F]`` float64 on CPU (``FeatureLayout``:
        the features and the squared standard errors of the mass profile), averaged over ranks."""
        probe = run_probe(
            model,
            tokens,
            doc_ids,
            n_sequences=self.settings.need.probe_sequences,
            n_queries=self.settings.need.probe_queries,
            generator=self.probe_generator,
        )
        return self.rank_mean(features.probe_features(probe, self.candidates))

    def rank_mean(self, x: Tensor, extra_se2: slice | None = None) -> Tensor:
        """Packed features (and a signal's columns) averaged over ranks, float64 on CPU: every rank decides on the
        same numbers. Squared standard errors (the profile's, and ``extra_se2``) are those of the mean."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            world = dist.get_world_size()
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
            x = x / world
            x[..., self.layout.profile_se2] /= world  # the mean of ``world`` independent probes
            if extra_se2 is not None:
                x[..., extra_se2] /= world
        return x.to("cpu", torch.float64)

    def profiles(self, x: Tensor) -> Tensor:
        """Mass profile ``[L, H, K]`` from packed features; a window >= T holds all of the mass, exactly."""
        m = x[..., self.layout.profile].clone()
        m[..., [i for i, c in enumerate(self.candidates) if c >= self.seq_len]] = 1.0
        return m

    # -- deciding ----------------------------------------------------------------------------------------------------
    def decide(self, x: Tensor, step: int) -> Tensor:
        """One control decision from this step's rank-averaged measurement ``x`` ``[L, H, F]``: the new table.
        The pipeline of docs/controller.md: smooth, need, ceiling, (explorers), kept reach, group, allocate, settle."""
        x = x.to(torch.float64)
        probe = self.signal.features(x)[..., : self.layout.size]
        self.ema = smooth(self.ema, probe, self.settings.need.ema_alpha)
        need, noise, capped = self.signal.need(x, self.profiles(self.ema))
        ceiling, forming = self.budget.ceiling(step), self.reach_first.forming(step)
        if forming and self.settings.reach.formation_fill == "even":  # the signals are smoothed, the table is set
            return self._record(self.reach_first.table(self.reach_first.even_fill(ceiling)), step, probe, need)
        kept = {}
        if not forming and self.settings.reach.heads and ceiling is not None:
            kept = reach.kept_reach(
                need, ceiling, self.budget.units(), self.budget.costs, self.candidates, self.settings.reach
            )
        before = (list(self.grouper.partitions), list(self.hierarchies), list(self.group_windows))
        inputs = [self.layer_inputs(layer, need, noise, capped, forming, kept) for layer in range(self.n_layer)]
        if ceiling is not None:
            chosen = allocate_within_budget(inputs, self.budget.measure, ceiling, self.settings.budget.scope)
        else:
            chosen = [self.allocator(one) for one in inputs]
        table = self.write_table(inputs, chosen)
        if ceiling is not None and self.table is not None:
            for layers in settling.kept_units(
                self.table, table, need, noise, ceiling, self.budget.units(), self.candidates,
                self.budget.table_cost, self.settings.settle.margin, kept,
            ):  # fmt: skip
                table[layers] = self.table[layers]
                for layer in layers:  # the table in force stays, and so do its groups
                    self.grouper.partitions[layer] = before[0][layer]
                    self.hierarchies[layer], self.group_windows[layer] = before[1][layer], before[2][layer]
        return self._record(table, step, probe, need)

    def layer_inputs(self, layer: int, need: Tensor, noise: Tensor, capped: bool, forming: bool, kept: dict):
        """What the allocation of ``layer`` reads: its hierarchy of head groups (explorers and kept heads alone in
        theirs), its need and settle bands, the table in force and the heads' floors."""
        c, g = self.settings, self.settings.groups
        z = features.clustering_matrix(self.ema[layer], g.feature_set, self.candidates, self.seq_len, g.feature_floor)
        d = pairwise_distances(z, g.metric)
        level0 = self.grouper.level0(layer, d, self.reach_first.apart(forming, layer, kept))
        held = None if self.table is None else torch.searchsorted(self.candidate_tensor, self.table[layer]).tolist()
        return LayerInputs(
            hierarchy=build_hierarchy(d, level0, self.thresholds[1:]),
            profile=need[layer],
            features=self.ema[layer],
            candidates=self.candidates,
            seq_len=self.seq_len,
            sink=self.budget.sink,
            coverage_target=c.allocation.coverage_target,
            parent_constraint=c.allocation.parent_constraint,
            layer=layer,
            current=held,
            settle_margin=settling.settle_bands(noise[layer], c.settle.margin),
            floors=self.reach_first.floors(forming, layer, kept),
            capped=capped,
        )

    @property
    def candidate_tensor(self) -> Tensor:
        return torch.tensor(self.candidates, dtype=torch.int32)

    def write_table(self, inputs: list[LayerInputs], chosen: list[list[list[int]]]) -> Tensor:
        """The table of the chosen candidate indices ``[layer][level][group]``; each layer's hierarchy and group
        windows are kept for the diagnostics."""
        table = torch.empty(self.n_layer, self.n_head, dtype=torch.int32)
        for layer, (one, chosen_layer) in enumerate(zip(inputs, chosen)):
            if self.settings.allocation.parent_constraint:
                _check_parent_constraint(one.hierarchy, chosen_layer)
            for group, idx in zip(one.hierarchy.levels[0], chosen_layer[0]):
                table[layer, group] = self.candidates[idx]
            self.hierarchies[layer] = one.hierarchy
            self.group_windows[layer] = [[self.candidates[i] for i in level] for level in chosen_layer]
        return table

    def _record(self, table: Tensor, step: int, x: Tensor, need: Tensor) -> Tensor:
        """The decided ``table`` in force from ``step``: its spend, coverage on this probe, and the need behind it."""
        self.budget.spend.record(step, self.budget.table_cost(table))
        index = torch.searchsorted(self.candidate_tensor, table)
        self.last_coverage = self.profiles(x).gather(-1, index.long().unsqueeze(-1)).squeeze(-1)
        self.last_need = need.clone()
        self.table, self.last_step = table, step
        self.decisions += 1
        return table.clone()

    def set_run_length(self, total_steps: int) -> None:
        """The run's number of optimizer steps (the LightningModule calls this when training starts). With
        ``budget_over_run``, a target the run cannot meet is an error now, before any step."""
        self.budget.run_steps = int(total_steps)
        if not self.decisions:  # a resumed run was checked when it started
            c = self.settings
            explorers = (c.reach.formation_steps, self.budget.table_cost(self.reach_first.table()))
            self.budget.check_run(c.schedule.warmup_steps, explorers if self.reach_first.on else None)

    # -- for callbacks -----------------------------------------------------------------------------------------------
    def report(self) -> PolicyReport:
        out = _report(self.candidates, self.last_step, self.hierarchies, self.group_windows)
        out.need, out.need_signal = self.last_need, self.settings.need.signal
        return out

    @classmethod
    def report_from_state(cls, state: dict, candidates: list[int]) -> PolicyReport:
        hierarchies = [None if h is None else Hierarchy.from_state(h) for h in state.get("hierarchies") or []]
        windows = state.get("group_windows") or [None] * len(hierarchies)
        step = state.get("last_step")
        out = _report(candidates, None if step is None or step < 0 else int(step), hierarchies, windows)
        out.need = state.get("last_need")
        return out

    # -- state -------------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain tensors, lists and ints only (loads with ``torch.load(weights_only=True)``); one flat mapping with
        the parts' state, so that checkpoints of every earlier layout resume."""
        return {
            "ema": None if self.ema is None else self.ema.clone(),
            **self.grouper.state_dict(),
            "hierarchies": [None if h is None else h.to_state() for h in self.hierarchies],
            "group_windows": [None if w is None else [list(lv) for lv in w] for w in self.group_windows],
            "table": None if self.table is None else self.table.clone(),
            "last_step": -1 if self.last_step is None else self.last_step,
            "decisions": self.decisions,
            "last_coverage": None if self.last_coverage is None else self.last_coverage.clone(),
            "probe_generator": self.probe_generator.get_state(),
            # Stateful allocators (``paper``: its fixed random networks) resume with the same weights.
            "allocator": self.allocator.state_dict() if hasattr(self.allocator, "state_dict") else {},
            "spend": self.budget.spend.state_dict(),
            "gain_ema": None,  # written by the gain signal; kept for one layout of every checkpoint
            "gain_se2_ema": None,
            **self.signal.state_dict(),
            "last_need": None if self.last_need is None else self.last_need.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        if not state:
            return
        self.ema = None if state["ema"] is None else state["ema"].to(torch.float64).clone()
        expected = (self.n_layer, self.n_head, self.layout.size)
        if self.ema is not None and tuple(self.ema.shape) != expected:
            raise ConfigError(
                f"the checkpoint's controller state has features of shape {tuple(self.ema.shape)} (layers, heads, "
                f"features), this run expects {expected}: model.gpt.n_layer, model.gpt.n_head and model.aah.candidates must "
                f"match the checkpoint"
            )
        self.grouper.load_state_dict(state)
        self.hierarchies = [None if h is None else Hierarchy.from_state(h) for h in state["hierarchies"]]
        self.group_windows = [None if w is None else [list(lv) for lv in w] for w in state["group_windows"]]
        self.table = None if state["table"] is None else state["table"].to(torch.int32).clone()
        self.last_step = None if state["last_step"] < 0 else int(state["last_step"])
        self.decisions = int(state["decisions"])
        cov = state.get("last_coverage")
        self.last_coverage = None if cov is None else cov.clone()
        self.probe_generator.set_state(state["probe_generator"])
        if state.get("allocator") and hasattr(self.allocator, "load_state_dict"):
            self.allocator.load_state_dict(state["allocator"])
        if "spend" in state:  # optional: a state without it has counted no spend
            self.budget.spend.load_state_dict(state["spend"])
        self.signal.load_state_dict(state)
        need = state.get("last_need")  # optional: older checkpoints have none
        self.last_need = None if need is None else need.to(torch.float64).clone()


def _check_parent_constraint(hierarchy: Hierarchy, chosen: list[list[int]]) -> None:
    for level in range(len(hierarchy.levels) - 1):
        parents = hierarchy.parents(level)
        for g, p in enumerate(parents):
            if chosen[level][g] > chosen[level + 1][p]:
                raise RuntimeError(
                    f"allocator broke the parent constraint: level {level} group {g} index {chosen[level][g]} > "
                    f"parent index {chosen[level + 1][p]}"
                )


def _report(candidates, last_step, hierarchies, group_windows) -> PolicyReport:
    """The decision as diagnostics read it; no trees before the first decision."""
    trees = [
        None if h is None else GroupTree(h.levels, None if w is None else [list(map(int, lv)) for lv in w])
        for h, w in zip(hierarchies, group_windows)
    ]
    return PolicyReport(list(candidates), last_step, trees if any(t is not None for t in trees) else None)
