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
from aah_lightning.windows import metrics
from aah_lightning.windows.config import AAHConfig
from aah_lightning.windows.controller import features
from aah_lightning.windows.controller.allocators import LayerInputs
from aah_lightning.windows.controller.budget import RunSpend, allocate_within_budget
from aah_lightning.windows.controller.gain import run_gain_probe
from aah_lightning.windows.controller.grouping import (
    Partition,
    canonical,
    cluster_heads,
    pairwise_distances,
    random_partition,
    singletons,
)
from aah_lightning.windows.controller.hierarchy import build_hierarchy
from aah_lightning.windows.controller.registry import ALLOCATORS, make_allocator
from aah_lightning.windows.groups import GroupTree, Hierarchy
from aah_lightning.windows.policy_base import PolicyReport, WindowPolicy, register
from aah_lightning.windows.probe import run_probe

# A move must gain more than this many standard errors of the probe's estimate of the kept mass (``settle_bands``).
SETTLE_SIGMAS = 2.0


@register("adaptive")
class AdaptivePolicy(WindowPolicy):
    """Windows chosen from head statistics through a hierarchy of head groups (settings: ``ControllerConfig``)."""

    def __init__(self, cfg: AAHConfig, n_layer: int, n_head: int, seq_len: int):
        super().__init__(cfg, n_layer, n_head, seq_len)
        self.settings = cfg.controller
        self.layout = features.FeatureLayout(len(self.candidates))
        self.allocator = make_allocator(self.settings, n_layer, self.candidates, cfg.seed)
        self.budget = self.settings.budget()  # (measure, per-head target) or None
        self.costs = None if self.budget is None else metrics.window_costs(self.candidates, seq_len, self.budget[0])
        self.run_steps: int | None = None  # the run's length, for budget_over_run (set_run_length)
        # Level l of the hierarchy is cut at threshold * growth**l.
        self.thresholds = [
            self.settings.threshold * self.settings.threshold_growth**lvl for lvl in range(self.settings.depth)
        ]
        # Controller state (all of it in state_dict).
        self.probe_generator = torch.Generator().manual_seed(cfg.seed)
        self.partition_generator = torch.Generator().manual_seed(cfg.seed + 1)
        self.ema: Tensor | None = None  # [L, H, F] float64
        self.partitions: list[Partition | None] = [None] * n_layer  # level 0 of the last decision
        self.random_partitions: list[Partition | None] = [None] * n_layer
        self.hierarchies: list[Hierarchy | None] = [None] * n_layer
        self.group_windows: list[list[list[int]] | None] = [None] * n_layer
        self.table: Tensor | None = None  # int32 [L, H], the last decided table
        self.last_step: int | None = None
        self.decisions = 0
        self.last_coverage: Tensor | None = None
        # Reach first: the explorers' window, and the need signal that decided the last table ([L, H, K]).
        self.explore_index = self.candidates.index(self.settings.explore_window or self.candidates[-1])
        self.gain_ema: Tensor | None = None
        self.gain_se2_ema: Tensor | None = None  # its squared standard error (of moving from the table in force)
        self.last_need: Tensor | None = None
        self.spend = RunSpend(self.table_cost(self.initial_table()))

    @classmethod
    def validate(cls, cfg: AAHConfig, seq_len: int, n_layer: int, n_head: int) -> None:
        c, candidates = cfg.controller, cfg.resolved_candidates(seq_len)
        require(  # the registry is the controller's own: the settings' dataclass does not know it
            c.allocator in ALLOCATORS,
            "model.aah.controller.allocator",
            c.allocator,
            f"one of {', '.join(sorted(ALLOCATORS))}",
        )
        c.validate(candidates, seq_len, n_head)
        if c.reach_heads and c.budget() is not None:  # the kept reach must fit the target beside the narrowest rest
            n = n_head * (n_layer if c.budget_scope == "model" else 1)
            costs = metrics.window_costs(candidates, seq_len, c.budget()[0])
            fits = _reach_index(costs, c.budget()[1], n, c.reach_heads)
            key = "model.aah.controller."
            if c.reach_window is not None and candidates.index(c.reach_window) > fits:
                raise ConfigError(
                    f"{key}reach_window={c.reach_window!r} does not fit the budget: {c.reach_heads} head(s) at it beside "
                    f"{n - c.reach_heads} at {candidates[0]} cost more than {c.budget()[1]!r}; the widest that fits is "
                    f"{candidates[fits]}"
                )
            if fits == 0:
                raise ConfigError(
                    f"{key}reach_heads={c.reach_heads!r}: the budget {c.budget()[1]!r} leaves them no window wider than "
                    f"the narrowest candidate ({candidates[0]}); lower reach_heads or raise the budget"
                )

    def initial_table(self) -> Tensor:
        """Full context until the first decision; with explorers (reach first), the explorer table from step 0."""
        if not self.settings.explorers:
            return super().initial_table()
        if self.settings.formation_fill == "even":
            return self.explorer_table(self.even_fill(self.budget[1]))
        return self.explorer_table()

    def explorer_table(self, fill: int | None = None) -> Tensor:
        """Heads ``0 .. explorers - 1`` of every layer at ``explore_window``, every other head at ``fill`` (default
        the narrowest candidate)."""
        table = torch.full((self.n_layer, self.n_head), fill or self.candidates[0], dtype=torch.int32)
        table[:, : self.settings.explorers] = self.candidates[self.explore_index]
        return table

    def even_fill(self, ceiling: float) -> int:
        """The widest candidate every non-explorer can hold beside the explorers within ``ceiling`` (the narrowest
        when none fits): ``formation_fill: even``, one window for all the other heads while the explorers form."""
        fits = [c for c in self.candidates if self.table_cost(self.explorer_table(c)) <= ceiling + 1e-9]
        return fits[-1] if fits else self.candidates[0]

    def forming(self, step: int) -> bool:
        """Whether the explorers still hold their reach at ``step``."""
        return self.settings.explorers > 0 and step < self.settings.formation_steps

    # -- schedule ----------------------------------------------------------------------------------------------------
    def is_control_step(self, step: int) -> bool:
        c = self.settings
        if step < c.warmup_steps or (c.freeze_after is not None and step > c.freeze_after):
            return False
        return (step - c.warmup_steps) % c.control_interval == 0

    def on_train_step(self, step: int, model, batch) -> Tensor | None:
        if not self.is_control_step(step) or self.last_step == step:
            return None
        tokens, targets, docs = split_batch(batch)
        previous = self.table
        if self.settings.signal == "gain":
            x = self.measure_gain(model, tokens, targets, docs, batch.get("loss_mask"))
        else:
            x = self.measure(model, tokens, docs)
        table = self.decide(x, step)
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
            n_sequences=self.settings.probe_sequences,
            n_queries=self.settings.probe_queries,
            generator=self.probe_generator,
        )
        return self._rank_mean(features.probe_features(probe, self.candidates))

    def _rank_mean(self, x: Tensor, extra_se2: slice | None = None) -> Tensor:
        """Packed features (and gains) averaged over ranks, float64 on CPU: every rank decides on the same numbers."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            world = dist.get_world_size()
            dist.all_reduce(x, op=dist.ReduceOp.SUM)
            x = x / world
            x[..., self.layout.profile_se2] /= world  # the mean of ``world`` independent probes
            if extra_se2 is not None:
                x[..., extra_se2] /= world
        return x.to("cpu", torch.float64)

    def measure_gain(self, model, tokens, targets, doc_ids=None, loss_mask=None) -> Tensor:
        """The mass probe's packed features followed by the gain signal ``[L, H, K]`` and its squared standard error
        ``[L, H, K]`` (``gain.py``: one no-grad forward per head and candidate), averaged over ranks."""
        probe, gain, se2 = run_gain_probe(
            model,
            tokens,
            targets,
            doc_ids,
            loss_mask,
            self.candidates,
            n_sequences=self.settings.probe_sequences,
            n_queries=self.settings.probe_queries,
            generator=self.probe_generator,
        )
        x = features.probe_features(probe, self.candidates)
        k, f = len(self.candidates), x.shape[-1]
        packed = torch.cat([x, gain.to(x), se2.to(x)], dim=-1)
        return self._rank_mean(packed, slice(f + k, f + 2 * k))

    def split_gain(self, x: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Packed probe features, gain and gain squared standard error (None, None for the mass signal)."""
        k = len(self.candidates)
        if self.settings.signal != "gain" or x.shape[-1] < self.layout.packed_size + 2 * k:
            return x, None, None
        f = x.shape[-1] - 2 * k
        return x[..., :f], x[..., f : f + k], x[..., f + k :]

    def profiles(self, x: Tensor) -> Tensor:
        """Mass profile ``[L, H, K]`` from packed features; a window >= T holds all of the mass, exactly."""
        m = x[..., self.layout.profile].clone()
        m[..., [i for i, c in enumerate(self.candidates) if c >= self.seq_len]] = 1.0
        return m

    # -- deciding ----------------------------------------------------------------------------------------------------
    def decide(self, x: Tensor, step: int) -> Tensor:
        """One control decision from this step's rank-averaged features ``x`` ``[L, H, F]``: the new table."""
        c = self.settings
        x, gain, gain_se2 = self.split_gain(x.to(torch.float64))
        noise = self.profile_noise(x)
        x = x[..., : self.layout.size]
        if self.ema is None or c.ema_alpha == 0:
            self.ema = x.clone()
        else:
            self.ema = c.ema_alpha * self.ema + (1 - c.ema_alpha) * x
        profiles = self.profiles(self.ema)
        if gain is not None:  # the need the knapsack maximises: the smoothed loss decrease instead of mass
            a = c.ema_alpha
            if self.gain_ema is None or a == 0:
                self.gain_ema, self.gain_se2_ema = gain.clone(), gain_se2.clamp_min(0)
            else:  # the smoothed estimate and its variance (probes are independent draws)
                self.gain_ema = a * self.gain_ema + (1 - a) * gain
                self.gain_se2_ema = a * a * self.gain_se2_ema + (1 - a) ** 2 * gain_se2.clamp_min(0)
            profiles, noise = self.gain_ema.clone(), self.gain_se2_ema.sqrt()
        forming = self.forming(step)
        if forming and c.formation_fill == "even":  # no allocation yet: the signals are smoothed, the table is set
            return self._record(self.explorer_table(self.even_fill(self.ceiling(step))), step, x, profiles)
        cand = torch.tensor(self.candidates, dtype=torch.int32)
        held = None if self.table is None else torch.searchsorted(cand, self.table).tolist()
        before = (list(self.partitions), list(self.hierarchies), list(self.group_windows))
        ceiling = self.ceiling(step)
        reach = {} if forming or not c.reach_heads or ceiling is None else self.kept_reach(profiles, ceiling)
        inputs = []
        for layer in range(self.n_layer):
            z = features.clustering_matrix(
                self.ema[layer], c.feature_set, self.candidates, self.seq_len, c.feature_floor
            )
            d = pairwise_distances(z, c.metric)
            level0 = self._level0(layer, d)
            kept = sorted(h for (lyr, h) in reach if lyr == layer)
            if forming or kept:  # explorers and kept reach: groups of their own, their floors drag no other head
                level0 = _apart(level0, list(range(c.explorers)) if forming else kept)
            inputs.append(
                LayerInputs(
                    hierarchy=build_hierarchy(d, level0, self.thresholds[1:]),
                    profile=profiles[layer],
                    features=self.ema[layer],
                    candidates=self.candidates,
                    seq_len=self.seq_len,
                    coverage_target=c.coverage_target,
                    parent_constraint=c.parent_constraint,
                    layer=layer,
                    current=None if held is None else held[layer],
                    settle_margin=self.settle_bands(noise[layer]),
                    floors=[
                        self.explore_index if forming and h < c.explorers else reach.get((layer, h), 0)
                        for h in range(self.n_head)
                    ],
                    capped=gain is None,
                )
            )
            self.partitions[layer] = level0
        if ceiling is not None:
            chosen_all = allocate_within_budget(inputs, self.budget[0], ceiling, c.budget_scope)
        else:
            chosen_all = [self.allocator(one) for one in inputs]
        table = torch.empty(self.n_layer, self.n_head, dtype=torch.int32)
        for layer, (one, chosen) in enumerate(zip(inputs, chosen_all)):
            if c.parent_constraint:
                _check_parent_constraint(one.hierarchy, chosen)
            for group, idx in zip(one.hierarchy.levels[0], chosen[0]):
                table[layer, group] = cand[idx]
            self.hierarchies[layer] = one.hierarchy
            self.group_windows[layer] = [[self.candidates[i] for i in level] for level in chosen]
        if ceiling is not None and self.table is not None:
            for layers in self._kept_units(table, profiles, noise, ceiling, reach):
                table[layers] = self.table[layers]
                for layer in layers:
                    self.partitions[layer], self.hierarchies[layer], self.group_windows[layer] = (
                        before[0][layer],
                        before[1][layer],
                        before[2][layer],
                    )
        return self._record(table, step, x, profiles)

    def budget_units(self) -> list[list[int]]:
        """The layers that share one budget: all of them with ``budget_scope: model``, else each layer alone."""
        if self.settings.budget_scope == "model":
            return [list(range(self.n_layer))]
        return [[layer] for layer in range(self.n_layer)]

    def kept_reach(self, need: Tensor, ceiling: float) -> dict[tuple[int, int], int]:
        """``reach_heads``: ``{(layer, head): candidate index}`` of the heads that hold the reach window at this
        decision. In each budget unit, the ``reach_heads`` heads with the largest smoothed need ``[L, H, K]`` at the
        window (exact ties to the earlier layer and head); the window is ``reach_window`` or the widest they can hold
        beside every other head of the unit at the narrowest candidate, never wider than that."""
        c = self.settings
        out = {}
        for layers in self.budget_units():
            j = _reach_index(self.costs, ceiling, len(layers) * self.n_head, c.reach_heads)
            if c.reach_window is not None:
                j = min(j, self.candidates.index(c.reach_window))
            if j == 0:
                continue  # this ceiling affords no reach (budget_over_run late in a run): nothing is held
            heads = sorted((-float(need[lyr, h, j]), lyr, h) for lyr in layers for h in range(self.n_head))
            out.update({(lyr, h): j for _, lyr, h in heads[: c.reach_heads]})
        return out

    def _record(self, table: Tensor, step: int, x: Tensor, need: Tensor) -> Tensor:
        """The decided ``table`` in force from ``step``: its spend, coverage on this probe, and the need behind it."""
        self.spend.record(step, self.table_cost(table))
        index = torch.searchsorted(torch.tensor(self.candidates, dtype=torch.int32), table)
        self.last_coverage = self.profiles(x).gather(-1, index.long().unsqueeze(-1)).squeeze(-1)
        self.last_need = need.clone()
        self.table, self.last_step = table, step
        self.decisions += 1
        return table.clone()

    def profile_noise(self, x: Tensor) -> Tensor:
        """Standard error ``[L, H, K]`` of this probe's mass profile (0 where ``x`` carries none, e.g. in tests)."""
        if x.shape[-1] < self.layout.packed_size:
            return torch.zeros(self.n_layer, self.n_head, len(self.candidates), dtype=torch.float64)
        return x[..., self.layout.profile_se2].clamp_min(0).sqrt()

    def settle_bands(self, noise: Tensor) -> Tensor:
        """How much kept mass a move must gain, per head and candidate ``[H, K]``: ``settle_margin``, or
        ``SETTLE_SIGMAS`` standard errors of the probe's estimate where that is more; 0 when settling is off."""
        margin = self.settings.settle_margin
        if margin <= 0:
            return torch.zeros_like(noise)
        return torch.clamp(SETTLE_SIGMAS * noise, min=margin)

    def _kept_units(
        self, proposal: Tensor, profiles: Tensor, noise: Tensor, ceiling: float, reach: dict | None = None
    ) -> list[list[int]]:
        """Under a budget, the units (a layer, or the whole model with ``budget_scope: model``) whose table in force
        stays: it still fits the ceiling, and the proposal keeps no more attention mass than the moved heads need
        to gain, each ``settle_margin`` or ``SETTLE_SIGMAS`` standard errors of its gain's estimate where that is
        more. The proposal is the exact optimum, so it never keeps less mass than the table in force. With kept reach
        (``reach``: the heads that must hold it and its candidate index), a table in force stays only if as many of
        the unit's heads hold that window or wider: settling never undoes the kept reach."""
        margin = self.settings.settle_margin
        if margin <= 0:
            return []
        cand = torch.tensor(self.candidates, dtype=torch.int32)
        kept = []
        for layers in self.budget_units():
            old, new = self.table[layers], proposal[layers]
            moved = old != new
            if not moved.any() or self.table_cost(old) > ceiling + 1e-9:
                continue
            held = [j for (lyr, _h), j in (reach or {}).items() if lyr in layers]
            if held and int((old >= self.candidates[held[0]]).sum()) < len(held):
                continue  # the table in force lacks the reach this decision keeps
            idx = [torch.searchsorted(cand, t).long().unsqueeze(-1) for t in (old, new)]
            gain = float(profiles[layers].gather(-1, idx[1]).sum() - profiles[layers].gather(-1, idx[0]).sum())
            se = sum(noise[layers].gather(-1, i).squeeze(-1) for i in idx)  # bounds the SE of each head's gain
            if gain <= float(torch.clamp(SETTLE_SIGMAS * se, min=margin)[moved].sum()):
                kept.append(layers)
        return kept

    # -- budget ------------------------------------------------------------------------------------------------------
    def table_cost(self, table: Tensor) -> float:
        """Mean per-head cost of ``table`` in the budget's measure (ACR without a budget)."""
        if self.budget is not None and self.budget[0] == "causal_coverage":
            return float(metrics.causal_coverage(table, self.seq_len))
        return float(metrics.acr(table, self.seq_len))

    def ceiling(self, step: int) -> float | None:
        """The per-head budget of the decision at ``step``: the target, or with ``budget_over_run`` what the rest of
        the run may spend on average so that the run's mean meets the target."""
        if self.budget is None:
            return None
        if not self.settings.budget_over_run:
            return self.budget[1]
        return self.spend.ceiling(self.budget[1], step, self.run_steps, float(self.costs[0]))

    def set_run_length(self, total_steps: int) -> None:
        """The run's number of optimizer steps (the LightningModule calls this when training starts). With
        ``budget_over_run``, a target the run cannot meet is an error now, before any step."""
        self.run_steps = int(total_steps)
        if self.budget is None or not self.settings.budget_over_run or self.decisions:  # a resumed run was checked
            return
        measure, target = self.budget
        w = min(self.settings.warmup_steps, self.run_steps)
        paid = self.spend.paid_before(w)
        if self.settings.explorers:  # the explorers hold their reach until formation ends, whatever the budget
            w = min(max(w, self.settings.formation_steps), self.run_steps)
            paid = w * self.table_cost(self.explorer_table())
        least = (paid + (self.run_steps - w) * float(self.costs[0])) / self.run_steps
        if least > target + 1e-9:
            name = "target_acr" if measure == "acr" else "target_causal_coverage"
            start = (
                f"{w} steps of explorers (formation_steps) beside the smallest candidate"
                if self.settings.explorers
                else f"{w} warmup steps at full context"
            )
            raise ConfigError(
                f"model.aah.controller.{name}={target!r} cannot be the mean over this run: {start} and the smallest "
                f"candidate ({self.candidates[0]}) afterwards already average {least:.4f} over {self.run_steps} steps; "
                f"lower warmup_steps or formation_steps, add a smaller candidate or raise the target"
            )

    def _level0(self, layer: int, d: Tensor) -> Partition:
        c = self.settings
        if c.grouping == "none":
            return singletons(self.n_head)
        if c.grouping == "fixed_random":
            if self.random_partitions[layer] is None:
                self.random_partitions[layer] = random_partition(self.n_head, c.random_groups, self.partition_generator)
            return self.random_partitions[layer]
        previous = self.partitions[layer]
        if c.reuse_groups and previous is not None:
            return previous
        return cluster_heads(d, c.threshold, c.min_group_size, c.max_groups, previous, c.hysteresis)

    # -- for callbacks -----------------------------------------------------------------------------------------------
    def report(self) -> PolicyReport:
        out = _report(self.candidates, self.last_step, self.hierarchies, self.group_windows)
        out.need, out.need_signal = self.last_need, self.settings.signal
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
        """Plain tensors, lists and ints only (loads with ``torch.load(weights_only=True)``)."""
        return {
            "ema": None if self.ema is None else self.ema.clone(),
            "partitions": [None if p is None else [list(g) for g in p] for p in self.partitions],
            "random_partitions": [None if p is None else [list(g) for g in p] for p in self.random_partitions],
            "hierarchies": [None if h is None else h.to_state() for h in self.hierarchies],
            "group_windows": [None if w is None else [list(lv) for lv in w] for w in self.group_windows],
            "table": None if self.table is None else self.table.clone(),
            "last_step": -1 if self.last_step is None else self.last_step,
            "decisions": self.decisions,
            "last_coverage": None if self.last_coverage is None else self.last_coverage.clone(),
            "probe_generator": self.probe_generator.get_state(),
            "partition_generator": self.partition_generator.get_state(),
            # Stateful allocators (``paper``: its fixed random networks) resume with the same weights.
            "allocator": self.allocator.state_dict() if hasattr(self.allocator, "state_dict") else {},
            "spend": self.spend.state_dict(),
            "gain_ema": None if self.gain_ema is None else self.gain_ema.clone(),
            "gain_se2_ema": None if self.gain_se2_ema is None else self.gain_se2_ema.clone(),
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
        self.partitions = [None if p is None else [list(map(int, g)) for g in p] for p in state["partitions"]]
        self.random_partitions = [
            None if p is None else [list(map(int, g)) for g in p] for p in state["random_partitions"]
        ]
        self.hierarchies = [None if h is None else Hierarchy.from_state(h) for h in state["hierarchies"]]
        self.group_windows = [None if w is None else [list(lv) for lv in w] for w in state["group_windows"]]
        self.table = None if state["table"] is None else state["table"].to(torch.int32).clone()
        self.last_step = None if state["last_step"] < 0 else int(state["last_step"])
        self.decisions = int(state["decisions"])
        cov = state.get("last_coverage")
        self.last_coverage = None if cov is None else cov.clone()
        self.probe_generator.set_state(state["probe_generator"])
        self.partition_generator.set_state(state["partition_generator"])
        if state.get("allocator") and hasattr(self.allocator, "load_state_dict"):
            self.allocator.load_state_dict(state["allocator"])
        if "spend" in state:  # optional: a state without it has counted no spend
            self.spend.load_state_dict(state["spend"])
        gain, need = state.get("gain_ema"), state.get("last_need")  # optional: older checkpoints have neither
        self.gain_ema = None if gain is None else gain.to(torch.float64).clone()
        se2 = state.get("gain_se2_ema")
        self.gain_se2_ema = None if se2 is None else se2.to(torch.float64).clone()
        self.last_need = None if need is None else need.to(torch.float64).clone()


def _apart(partition: Partition, heads: list[int]) -> Partition:
    """``partition`` with each of ``heads`` in a group of its own (groups in order of first head)."""
    out = [[h] for h in heads]
    out += [rest for rest in ([h for h in g if h not in heads] for g in partition) if rest]
    return canonical(out)


def _reach_index(costs: Tensor, ceiling: float, n: int, r: int) -> int:
    """The widest candidate index that ``r`` of ``n`` heads can hold beside ``n - r`` heads at the narrowest, with a
    mean per-head cost within ``ceiling`` (0 when none is wider than the narrowest)."""
    fits = [j for j in range(len(costs)) if r * float(costs[j]) + (n - r) * float(costs[0]) <= ceiling * n + 1e-9]
    return fits[-1] if fits else 0


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
