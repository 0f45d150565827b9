"""Settings of the window policy (the ``model.aah`` block of a config)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional

from aah_lightning.checkpoint import FLAT_CONTROLLER_SETTINGS, FLAT_POLICY_SETTINGS
from aah_lightning.errors import ConfigError, move_flat_setting, require
from aah_lightning.windows.metrics import window_costs
from aah_lightning.windows.registry import policy_class

# The controller's settings, one block per part of the controller (``model.aah.controller.<block>``). They live here,
# with every policy's settings as data, and not in the controller's modules: this module imports no policy code.
# Each block's docstring names the module that reads it.


@dataclass
class NeedConfig:
    """How need is measured (``model.aah.controller.need``; docs/controller.md, "Need signals").

    Attributes:
        signal: what a head's need for each candidate window is measured by: ``mass`` (the paper's statistics: the
            share of its full-causal attention mass inside the window), ``gain`` (counterfactual: the loss decrease of
            giving the head that window, measured by running the probe sequences with that one head's window
            changed; budget only, ``allocation.allocator: reach``), ``retrieval`` (the share of a head's copy-paste
            hits, on spans of the batch copied back at distances across the context, that each window keeps; one
            forward per decision, so it scales to pretrained models; budget only), or ``module:name`` of a signal
            registered in an importable module (``register_signal``).
        probe_sequences: sequences of the current batch the probe runs (cost does not grow with the batch size); for
            ``retrieval``, the number of copy probes (rows of the batch are reused when it has fewer).
        probe_queries: query positions sampled per sequence (stratified over the sequence).
        ema_alpha: smoothing across control steps, ``m <- a*m + (1-a)*x``; 0 disables it.
        copy_span: tokens of each copy probe of the ``retrieval`` signal (the sequence must hold two of them).
    """

    signal: str = "mass"
    probe_sequences: int = 2
    probe_queries: int = 64
    ema_alpha: float = 0.5
    copy_span: int = 32

    def validate(self, key: str) -> None:
        require(self.probe_sequences >= 1, key + "probe_sequences", self.probe_sequences, "1 or more")
        require(self.probe_queries >= 1, key + "probe_queries", self.probe_queries, "1 or more")
        require(0 <= self.ema_alpha < 1, key + "ema_alpha", self.ema_alpha, "in [0, 1) (0 disables the EMA)")
        require(self.copy_span >= 2, key + "copy_span", self.copy_span, "2 or more")


@dataclass
class GroupsConfig:
    """How each layer's heads are grouped (``model.aah.controller.groups``; docs/controller.md, "One control step").

    Attributes:
        method: ``cluster`` (average-linkage agglomerative clustering), ``none`` (every head its own group),
            ``fixed_random`` (a seeded random partition into ``random_groups`` groups, drawn once per layer) or
            ``kv_heads`` (the query heads of each key/value head form one group, so that every window the budget
            buys is one a key/value head's cache can keep; ``kv_heads`` groups of consecutive heads).
        feature_set: what the heads are grouped by: ``paper`` (nine q/k/v/attention statistics), ``reach``
            (attention-mass profile over the candidates plus mean log-distance) or ``all`` (both, equal weight).
        feature_floor: a feature's spread across a layer's heads counts as noise below this fraction of its mean
            magnitude (standardisation divides by at least that, instead of blowing noise up to unit variance).
        metric: ``euclidean`` (RMS distance of standardised features) or ``cosine``.
        threshold: level-0 cut of the dendrogram (merge while the average linkage is at most this).
        threshold_growth: level l is cut at ``threshold * threshold_growth**l``.
        min_group_size: smaller level-0 groups are merged into their nearest group.
        max_groups: at most this many level-0 groups (None = no limit).
        hysteresis: keep the previous level-0 partition unless the new one scores better by this margin.
        random_groups: number of groups of ``fixed_random``.
        kv_heads: number of groups of ``kv_heads``: the model's ``n_kv_head`` (the run refuses another value).
        depth: at most this many hierarchy levels (1 = flat groups).
        reuse_groups: keep the level-0 partition of the first decision; keep re-allocating windows.
    """

    method: Literal["cluster", "none", "fixed_random", "kv_heads"] = "cluster"
    feature_set: Literal["paper", "reach", "all"] = "all"
    feature_floor: float = 0.05
    metric: Literal["euclidean", "cosine"] = "euclidean"
    threshold: float = 1.0
    threshold_growth: float = 1.5
    min_group_size: int = 1
    max_groups: Optional[int] = None
    hysteresis: float = 0.05
    random_groups: int = 2
    kv_heads: Optional[int] = None
    depth: int = 2
    reuse_groups: bool = False

    def validate(self, key: str, n_head: int) -> None:
        require(
            self.method in ("cluster", "none", "fixed_random", "kv_heads"),
            key + "method",
            self.method,
            "cluster, none, fixed_random or kv_heads",
        )
        if self.method == "kv_heads":
            require(
                isinstance(self.kv_heads, int) and self.kv_heads >= 1 and n_head % self.kv_heads == 0,
                key + "kv_heads",
                self.kv_heads,
                f"with method kv_heads, the model's n_kv_head: an integer that divides n_head={n_head}",
            )
        require(
            self.feature_set in ("paper", "reach", "all"), key + "feature_set", self.feature_set, "paper, reach or all"
        )
        require(self.metric in ("euclidean", "cosine"), key + "metric", self.metric, "euclidean or cosine")
        require(self.feature_floor >= 0, key + "feature_floor", self.feature_floor, ">= 0")
        require(self.threshold > 0, key + "threshold", self.threshold, "> 0")
        require(self.threshold_growth >= 1, key + "threshold_growth", self.threshold_growth, ">= 1")
        require(
            isinstance(self.min_group_size, int) and 1 <= self.min_group_size <= n_head,
            key + "min_group_size",
            self.min_group_size,
            f"an integer in [1, n_head={n_head}]",
        )
        require(
            self.max_groups is None or (isinstance(self.max_groups, int) and self.max_groups >= 1),
            key + "max_groups",
            self.max_groups,
            "None or an integer >= 1",
        )
        require(self.hysteresis >= 0, key + "hysteresis", self.hysteresis, ">= 0")
        require(
            isinstance(self.random_groups, int) and 1 <= self.random_groups <= n_head,
            key + "random_groups",
            self.random_groups,
            f"an integer in [1, n_head={n_head}]",
        )
        require(isinstance(self.depth, int) and self.depth >= 1, key + "depth", self.depth, "an integer >= 1")


@dataclass
class AllocationConfig:
    """How groups get windows (``model.aah.controller.allocation``).

    Attributes:
        allocator: without a budget, how groups get windows: ``reach`` (smallest candidate whose mass share reaches
            coverage_target) or ``paper`` (the authors' scorer networks, for parity studies: seeded random weights
            that are never trained, exactly as in the authors' code, where they never receive a gradient). With a
            budget the exact knapsack (``budget.py``) chooses, and only ``reach`` is allowed.
        paper_joint_scorer: the ``paper`` allocator's joint sibling scorer replaces the logits of sibling pairs (the
            paper's setting; off = every group scored on its own, the authors' setting for grouping_off).
        coverage_target: share of a group's full-causal attention mass its window must hold, in (0, 1].
        parent_constraint: a child group's window never exceeds its parent's (without a budget: the child is capped
            at what its parent's mass needs; under a budget a parent takes its widest child's window, so this always
            holds).
    """

    allocator: str = "reach"
    paper_joint_scorer: bool = True
    coverage_target: float = 0.9
    parent_constraint: bool = True

    def validate(self, key: str) -> None:
        require(0 < self.coverage_target <= 1, key + "coverage_target", self.coverage_target, "in (0, 1]")


@dataclass
class BudgetConfig:
    """The compute budget (``model.aah.controller.budget``; at most one target).

    Attributes:
        target_acr: a budget as a mean window / T (ACR): a ceiling on the mean per-head cost of each layer, or of the
            whole model (``scope``).
        target_causal_coverage: a budget as causal coverage, per layer or for the whole model (``scope``).
        scope: ``layer`` (each layer within the budget) or ``model`` (one budget for all layers). Either way
            ``budget.py`` chooses the window of every finest group exactly, maximising the kept need.
        over_run: the budget is the mean over the whole run, the full-context warmup included: each decision's
            ceiling is what the remaining steps may still spend.
    """

    target_acr: Optional[float] = None
    target_causal_coverage: Optional[float] = None
    scope: Literal["layer", "model"] = "layer"
    over_run: bool = False

    def target(self) -> tuple[str, float] | None:
        """``(measure, per-head budget)`` of the compute ceiling, or None."""
        if self.target_acr is not None:
            return "acr", float(self.target_acr)
        if self.target_causal_coverage is not None:
            return "causal_coverage", float(self.target_causal_coverage)
        return None

    def validate(self, key: str, candidates: list[int], seq_len: int, sink: int = 0) -> None:
        if self.target_acr is not None and self.target_causal_coverage is not None:
            raise ConfigError(
                f"{key}target_acr={self.target_acr!r} and {key}target_causal_coverage="
                f"{self.target_causal_coverage!r} are both set: give at most one compute budget"
            )
        for name, measure in (("target_acr", "acr"), ("target_causal_coverage", "causal_coverage")):
            budget = getattr(self, name)
            if budget is None:
                continue
            smallest = float(window_costs(candidates, seq_len, measure, sink)[0])
            require(
                smallest <= budget <= 1,
                key + name,
                budget,
                f"in [{smallest:.4g}, 1]: the smallest candidate window {candidates[0]} already costs {smallest:.4g}",
            )
        require(self.scope in ("layer", "model"), key + "scope", self.scope, "layer or model")
        for name, on in (("scope", self.scope == "model"), ("over_run", self.over_run)):
            require(
                not on or self.target() is not None,
                key + name,
                getattr(self, name),
                "only with a budget: set target_acr or target_causal_coverage",
            )


@dataclass
class ReachConfig:
    """Reach first and kept reach (``model.aah.controller.reach``; budget only).

    Attributes:
        explorers: reach first: this many heads of every layer (heads ``0 .. explorers - 1``; at initialisation every
            head is alike) hold ``explore_window`` from step 0 until ``formation_steps``, whatever the signal says,
            so that a head that needs context can learn to use it before need is measured. 0 = off.
        explore_window: the explorers' window (None = the widest candidate); one of the candidates.
        formation_steps: the explorers hold their reach until this step; afterwards reach goes where the signal
            measures need (the table in force stays unless a move gains more than ``settle.margin``).
        formation_fill: the other heads' windows while the explorers form: ``knapsack`` (chosen by the signal at
            every decision, from step 0) or ``even`` (one window for all of them, the widest the budget leaves; the
            signal is measured and smoothed but allocates nothing until formation ends).
        heads: keep reach: at every decision (after formation), this many heads of each budget unit (the whole model
            with ``budget.scope: model``, else each layer) hold ``window``: the heads whose smoothed need at that
            window is largest. The knapsack places the rest of the budget around them. A skill spread over several
            heads is worth little in any one head alone, so an additive knapsack may narrow them all below the reach
            the task needs; this keeps one head able to reach and lets the signal say which. 0 = off.
        window: the window the kept ``heads`` hold (None = the widest candidate they can hold beside every other head
            of their unit at the narrowest candidate, within the decision's ceiling).
    """

    explorers: int = 0
    explore_window: Optional[int] = None
    formation_steps: int = 0
    formation_fill: Literal["knapsack", "even"] = "knapsack"
    heads: int = 0
    window: Optional[int] = None

    def validate(self, key: str, candidates: list[int], n_head: int, budgeted: bool) -> None:
        require(
            isinstance(self.explorers, int) and 0 <= self.explorers <= n_head,
            key + "explorers",
            self.explorers,
            f"an integer in [0, n_head={n_head}] (0 = no reach first)",
        )
        require(
            self.explore_window is None or self.explore_window in candidates,
            key + "explore_window",
            self.explore_window,
            f"None (the widest candidate) or one of the candidates {candidates}",
        )
        require(self.formation_steps >= 0, key + "formation_steps", self.formation_steps, ">= 0")
        require(
            self.formation_fill in ("knapsack", "even"), key + "formation_fill", self.formation_fill, "knapsack or even"
        )
        require(
            isinstance(self.heads, int) and 0 <= self.heads <= n_head,
            key + "heads",
            self.heads,
            f"an integer in [0, n_head={n_head}] (0 = off)",
        )
        require(
            self.window is None or self.window in candidates,
            key + "window",
            self.window,
            f"None (the widest the budget affords) or one of the candidates {candidates}",
        )
        for name, on in (("explorers", self.explorers > 0), ("heads", self.heads > 0)):
            require(
                not on or budgeted,
                key + name,
                getattr(self, name),
                "only with a budget (target_acr or target_causal_coverage): without one nothing limits reach",
            )
        require(
            self.explorers == 0 or self.formation_steps > 0,
            key + "formation_steps",
            self.formation_steps,
            "> 0 with explorers (how long they hold their reach)",
        )


@dataclass
class SettleConfig:
    """When a window moves (``model.aah.controller.settle``).

    Attributes:
        margin: how much a decision must gain before a window moves, so that a table stops changing when nothing
            changes but probe noise. Without a budget, a dead band around ``coverage_target``: a group grows only
            when its window holds less than ``coverage_target - margin`` of its mass and shrinks only to a window
            holding at least ``coverage_target + margin``. Under a budget, the table in force stays (per layer, or
            for the model) while it fits the ceiling and the new choice keeps less than this much more attention
            mass per head it would move. 0 = always take the new choice.
    """

    margin: float = 0.02

    def validate(self, key: str) -> None:
        require(0 <= self.margin < 1, key + "margin", self.margin, "in [0, 1) (0 = off)")


@dataclass
class ScheduleConfig:
    """When the controller decides (``model.aah.controller.schedule``).

    Attributes:
        warmup_steps: every head sees the full context until this step; the first decision is made here.
        control_interval: decide every this many steps after warmup.
        freeze_after: no decision after this step (None = never freeze); ``= warmup_steps`` decides once.
        rewind: calibrate-and-rewind: the ``warmup_steps`` before the first decision are a calibration (full
            context); right after that decision the model's weights go back to those of step 0, the optimizer's
            state is cleared and the learning-rate schedule starts again, and training goes on with the table it
            chose (``lit/rewind.py``). The calibration's steps and their attention cost count in the run's.
    """

    warmup_steps: int = 100
    control_interval: int = 50
    freeze_after: Optional[int] = None
    rewind: bool = False

    def validate(self, key: str) -> None:
        require(self.warmup_steps >= 0, key + "warmup_steps", self.warmup_steps, ">= 0")
        require(self.control_interval >= 1, key + "control_interval", self.control_interval, ">= 1")
        require(
            self.freeze_after is None or self.freeze_after >= self.warmup_steps,
            key + "freeze_after",
            self.freeze_after,
            f"None or >= warmup_steps={self.warmup_steps} (else no decision is ever made)",
        )
        require(
            not self.rewind or self.warmup_steps >= 1,
            key + "rewind",
            self.rewind,
            f"false with warmup_steps={self.warmup_steps}: a rewind needs a calibration (warmup_steps >= 1)",
        )

    def is_control_step(self, step: int) -> bool:
        if step < self.warmup_steps or (self.freeze_after is not None and step > self.freeze_after):
            return False
        return (step - self.warmup_steps) % self.control_interval == 0


@dataclass
class ControllerConfig:
    """Settings of the ``adaptive`` policy: the AAH controller (``model.aah.controller``; docs/controller.md). Each
    block sits beside the code that reads it and checks itself.

    Attributes:
        need: how need is measured: the signal, the probe, the smoothing (``NeedConfig``, ``controller/signals.py``).
        groups: how each layer's heads are grouped into a hierarchy (``GroupsConfig``, ``controller/grouping.py``).
        allocation: how groups get windows without a budget, and the coverage a window holds (``AllocationConfig``,
            ``controller/allocators.py``).
        budget: the compute budget, its scope and whether it is a mean over the run (``BudgetConfig``,
            ``controller/ceiling.py``).
        reach: reach first (explorers) and kept reach (``ReachConfig``, ``controller/reach.py``).
        settle: when a window moves (``SettleConfig``, ``controller/settling.py``).
        schedule: when the controller decides (``ScheduleConfig``, ``controller/schedule.py``).
        signal: deprecated, now ``need.signal``.
        probe_sequences: deprecated, now ``need.probe_sequences``.
        probe_queries: deprecated, now ``need.probe_queries``.
        ema_alpha: deprecated, now ``need.ema_alpha``.
        grouping: deprecated, now ``groups.method``.
        feature_set: deprecated, now ``groups.feature_set``.
        feature_floor: deprecated, now ``groups.feature_floor``.
        metric: deprecated, now ``groups.metric``.
        threshold: deprecated, now ``groups.threshold``.
        threshold_growth: deprecated, now ``groups.threshold_growth``.
        min_group_size: deprecated, now ``groups.min_group_size``.
        max_groups: deprecated, now ``groups.max_groups``.
        hysteresis: deprecated, now ``groups.hysteresis``.
        random_groups: deprecated, now ``groups.random_groups``.
        depth: deprecated, now ``groups.depth``.
        reuse_groups: deprecated, now ``groups.reuse_groups``.
        allocator: deprecated, now ``allocation.allocator``.
        paper_joint_scorer: deprecated, now ``allocation.paper_joint_scorer``.
        coverage_target: deprecated, now ``allocation.coverage_target``.
        parent_constraint: deprecated, now ``allocation.parent_constraint``.
        target_acr: deprecated, now ``budget.target_acr``.
        target_causal_coverage: deprecated, now ``budget.target_causal_coverage``.
        budget_scope: deprecated, now ``budget.scope``.
        budget_over_run: deprecated, now ``budget.over_run``.
        explorers: deprecated, now ``reach.explorers``.
        explore_window: deprecated, now ``reach.explore_window``.
        formation_steps: deprecated, now ``reach.formation_steps``.
        formation_fill: deprecated, now ``reach.formation_fill``.
        reach_heads: deprecated, now ``reach.heads``.
        reach_window: deprecated, now ``reach.window``.
        settle_margin: deprecated, now ``settle.margin``.
        warmup_steps: deprecated, now ``schedule.warmup_steps``.
        control_interval: deprecated, now ``schedule.control_interval``.
        freeze_after: deprecated, now ``schedule.freeze_after``.
    """

    # The flat keys of earlier versions: accepted, moved into their blocks, never suggested for a mistyped key.
    DEPRECATED_FIELDS = frozenset(FLAT_CONTROLLER_SETTINGS)

    need: NeedConfig = field(default_factory=NeedConfig)
    groups: GroupsConfig = field(default_factory=GroupsConfig)
    allocation: AllocationConfig = field(default_factory=AllocationConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    reach: ReachConfig = field(default_factory=ReachConfig)
    settle: SettleConfig = field(default_factory=SettleConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    # Deprecated: the flat layout of earlier versions, moved into the blocks with one deprecation line.
    signal: Optional[str] = None
    probe_sequences: Optional[int] = None
    probe_queries: Optional[int] = None
    ema_alpha: Optional[float] = None
    grouping: Optional[str] = None
    feature_set: Optional[str] = None
    feature_floor: Optional[float] = None
    metric: Optional[str] = None
    threshold: Optional[float] = None
    threshold_growth: Optional[float] = None
    min_group_size: Optional[int] = None
    max_groups: Optional[int] = None
    hysteresis: Optional[float] = None
    random_groups: Optional[int] = None
    depth: Optional[int] = None
    reuse_groups: Optional[bool] = None
    allocator: Optional[str] = None
    paper_joint_scorer: Optional[bool] = None
    coverage_target: Optional[float] = None
    parent_constraint: Optional[bool] = None
    target_acr: Optional[float] = None
    target_causal_coverage: Optional[float] = None
    budget_scope: Optional[str] = None
    budget_over_run: Optional[bool] = None
    explorers: Optional[int] = None
    explore_window: Optional[int] = None
    formation_steps: Optional[int] = None
    formation_fill: Optional[str] = None
    reach_heads: Optional[int] = None
    reach_window: Optional[int] = None
    settle_margin: Optional[float] = None
    warmup_steps: Optional[int] = None
    control_interval: Optional[int] = None
    freeze_after: Optional[int] = None

    def __post_init__(self):
        for name, cls in _CONTROLLER_BLOCKS.items():
            if isinstance(getattr(self, name), dict):  # from checkpoint hyper-parameters or a plain dict
                setattr(self, name, cls(**getattr(self, name)))
        # max_groups, explore_window, reach_window, target_* and freeze_after default to None in their blocks, so a
        # flat None cannot be told from "not given": only values other than None move.
        for key, (block, name) in FLAT_CONTROLLER_SETTINGS.items():
            value = getattr(self, key)
            if value is None:
                continue
            default = getattr(_CONTROLLER_BLOCKS[block](), name)
            move_flat_setting("model.aah.controller", key, value, [(block, getattr(self, block), name, default)], 3)
            setattr(self, key, None)

    def validate(self, candidates: list[int], seq_len: int, n_head: int, sink: int = 0) -> None:
        key = "model.aah.controller."
        self.need.validate(key + "need.")
        if self.need.signal == "retrieval":  # a probe holds the span and its copy
            require(
                2 * self.need.copy_span + 1 <= seq_len,
                key + "need.copy_span",
                self.need.copy_span,
                f"at most (seq_len - 1) / 2 = {(seq_len - 1) // 2} (a probe holds the span and its copy)",
            )
        self.groups.validate(key + "groups.", n_head)
        self.allocation.validate(key + "allocation.")
        self.budget.validate(key + "budget.", candidates, seq_len, sink)
        self.reach.validate(key + "reach.", candidates, n_head, self.budget.target() is not None)
        self.settle.validate(key + "settle.")
        self.schedule.validate(key + "schedule.")
        require(  # the calibration is the full-context warmup: explorers would make it a formation instead
            not (self.schedule.rewind and self.reach.explorers),
            key + "schedule.rewind",
            self.schedule.rewind,
            f"false with reach.explorers={self.reach.explorers}: the calibration a rewind measures is the full-context "
            f"warmup (kept reach, reach.heads, is allowed)",
        )
        if self.budget.target() is not None and self.allocation.allocator != "reach":
            raise ConfigError(
                f"{key}allocation.allocator={self.allocation.allocator!r} does not take a compute budget (its "
                f"decisions have no notion of cost): use allocator: reach, or remove budget.target_acr / "
                f"budget.target_causal_coverage"
            )


_CONTROLLER_BLOCKS = {
    "need": NeedConfig,
    "groups": GroupsConfig,
    "allocation": AllocationConfig,
    "budget": BudgetConfig,
    "reach": ReachConfig,
    "settle": SettleConfig,
    "schedule": ScheduleConfig,
}


@dataclass
class FixedConfig:
    """Settings of the ``fixed`` policy (``model.aah.fixed``).

    Attributes:
        window: every head's window.
        warmup_steps: every head sees the whole context for this many steps first, then ``window`` (the control that
            gives one window for all the controller's full-context warmup).
    """

    window: Optional[int] = None
    warmup_steps: int = 0


@dataclass
class StaticConfig:
    """Settings of the ``static`` policy (``model.aah.static``).

    Attributes:
        table: the windows, one list of ``n_head`` ints per layer.
    """

    table: Optional[list[list[int]]] = None


@dataclass
class RandomConfig:
    """Settings of the ``random`` policy (``model.aah.random``).

    Attributes:
        table: the windows each draw places at random over all heads (one list of ``n_head`` ints per layer); None:
            each head draws from the candidates.
        long_layer: with a ``table``: its widest window goes to a random head of this layer and the other windows at
            random over the remaining heads (a placement stratified by layer); None = anywhere.
        redraw_interval: draw again every this many steps (0 = draw once at the start).
    """

    table: Optional[list[list[int]]] = None
    long_layer: Optional[int] = None
    redraw_interval: int = 0


@dataclass
class ShuffleConfig:
    """Settings of the ``shuffle`` policy (``model.aah.shuffle``; the controller it wraps reads
    ``model.aah.controller``).

    Attributes:
        redraw_interval: re-permute every this many steps as well as at each decision (0 = at decisions only).
    """

    redraw_interval: int = 0


@dataclass
class SpanConfig:
    """Settings of the ``learned_span`` policy (``model.aah.span``; ``windows/span.py``).

    Attributes:
        target_acr: the budget: the heads' mean ``min(T, span + width) / T`` never exceeds it (each step's spans are
            projected onto it); the hard windows ``ceil(span + width)`` are what the run pays.
        width: the ramp's width R in tokens: the weight of a key falls from 1 at ``span`` to 0 at ``span + width``.
        freeze_at: the step at which the spans stop learning and become hard windows (no ramp) for the rest of the
            run; at least 1.
        lr: the spans' peak learning rate (their own AdamW group, no weight decay, the run's schedule); a span is a
            fraction of T, so one step moves it by about ``lr * T`` tokens at most.
        full_heads: at ``freeze_at``, this many heads with the widest spans get the whole context, and every other
            span is lowered by one common amount to pay for them (0: the spans as learned).
    """

    target_acr: Optional[float] = None
    width: int = 32
    freeze_at: Optional[int] = None
    lr: float = 0.01
    full_heads: int = 0


_BLOCKS = {
    "fixed": FixedConfig,
    "static": StaticConfig,
    "random": RandomConfig,
    "shuffle": ShuffleConfig,
    "span": SpanConfig,
}
# The settings of ``model.aah`` that one policy reads and another does not (``WindowPolicy.reads``); ``seed`` and
# ``sink`` are not among them: every policy that draws reads the seed, and the sink is the model's.
POLICY_SETTINGS = ("candidates", "fixed", "static", "random", "shuffle", "controller", "span")


def _changed(key: str, value, default) -> list[str]:
    """``key=value`` for every setting under ``key`` (a dataclass block: each of its fields) that differs from its
    default."""
    if hasattr(value, "__dataclass_fields__") and type(value) is type(default):
        return [
            line for name in value.__dataclass_fields__
            for line in _changed(f"{key}.{name}", getattr(value, name), getattr(default, name))
        ]  # fmt: skip
    return [] if value == default else [f"{key}={value!r}"]


@dataclass
class AAHConfig:
    """Which policy writes the window table, and its settings.

    Attributes:
        policy: a registered policy: ``full`` (every head W = T), ``fixed`` (every head one window, settings in
            ``fixed``), ``static`` (an explicit table, in ``static``), ``random`` (a seeded draw from ``candidates``,
            or a table's windows placed at random over all heads; in ``random``), ``adaptive`` (the AAH controller,
            settings in ``controller``), ``shuffle`` (the controller's table with each layer's windows permuted
            among its heads at every decision and, with ``shuffle.redraw_interval`` > 0, every that many steps; a
            control), ``learned_span`` (one learned soft span per head under a budget, then hard windows; in
            ``span``), or ``module:name`` of a policy registered in an importable module (docs/architecture.md,
            "Adding a window policy"; its settings in ``plugin``).
        candidates: the window sizes a policy may choose from, ascending; default ``[T/8, T/4, T/2, T]``.
        seed: seed of the ``random`` policy (and of the ``adaptive`` policy's probe sampling, random grouping and
            ``paper`` allocator networks, and of the ``shuffle`` permutations).
        sink: attention sink: the first ``sink`` positions of the sequence (with ``model.gpt.document_mask``, of each
            query's document) stay visible to every head whose window does not cover the sequence, whatever its
            window (StreamingLLM's sink tokens; pretrained models need a few, docs/retrofit.md). 0 (default): none.
            One value for the whole model; ACR, causal coverage and the controller's budget count its pairs.
        fixed: settings of the ``fixed`` policy (``FixedConfig``).
        static: settings of the ``static`` policy (``StaticConfig``).
        random: settings of the ``random`` policy (``RandomConfig``).
        shuffle: settings of the ``shuffle`` policy (``ShuffleConfig``).
        span: settings of the ``learned_span`` policy (``SpanConfig``).
        controller: settings of the ``adaptive`` policy, and of the controller ``shuffle`` wraps (``ControllerConfig``).
        plugin: settings of a policy registered outside the package, a mapping that policy reads and checks itself
            (``model.aah.plugin.window: 8``).
        window: deprecated, now ``fixed.window``.
        table: deprecated, now ``static.table`` (and ``random.table``).
        redraw_interval: deprecated, now ``random.redraw_interval`` (and ``shuffle.redraw_interval``).
        long_layer: deprecated, now ``random.long_layer``.
        warmup_steps: deprecated, now ``fixed.warmup_steps``.
    """

    policy: str = "full"
    candidates: Optional[list[int]] = None
    seed: int = 0
    sink: int = 0
    fixed: FixedConfig = field(default_factory=FixedConfig)
    static: StaticConfig = field(default_factory=StaticConfig)
    random: RandomConfig = field(default_factory=RandomConfig)
    shuffle: ShuffleConfig = field(default_factory=ShuffleConfig)
    span: SpanConfig = field(default_factory=SpanConfig)
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    plugin: dict[str, Any] = field(default_factory=dict)
    window: Optional[int] = None
    table: Optional[list[list[int]]] = None
    redraw_interval: Optional[int] = None
    long_layer: Optional[int] = None
    warmup_steps: Optional[int] = None

    def __post_init__(self):
        if isinstance(self.controller, dict):  # from checkpoint hyper-parameters or a plain dict
            self.controller = ControllerConfig(**self.controller)
        for name, cls in _BLOCKS.items():
            if isinstance(getattr(self, name), dict):
                setattr(self, name, cls(**getattr(self, name)))
        for key, blocks in FLAT_POLICY_SETTINGS.items():
            value = getattr(self, key)
            if value is None:
                continue
            targets = [(block, getattr(self, block), key, getattr(_BLOCKS[block](), key)) for block in blocks]
            move_flat_setting("model.aah", key, value, targets, stacklevel=3)
            setattr(self, key, None)

    def settings(self) -> dict:
        """The settings as plain dicts, without the deprecated flat keys (what a checkpoint saves)."""
        out = {k: v for k, v in asdict(self).items() if k not in FLAT_POLICY_SETTINGS}
        out["controller"] = {k: v for k, v in out["controller"].items() if k not in FLAT_CONTROLLER_SETTINGS}
        return out

    def validate_sink(self) -> None:
        require(
            isinstance(self.sink, int) and not isinstance(self.sink, bool) and self.sink >= 0,
            "model.aah.sink",
            self.sink,
            "an integer >= 0 (the first positions every windowed head keeps; 0 = none)",
        )

    def reads(self) -> Optional[frozenset[str]]:
        """Which of ``POLICY_SETTINGS`` the chosen policy reads; None for a policy that does not say (a plugin's)."""
        return policy_class(self.policy).reads(self)

    def ignored(self) -> list[str]:
        """The settings of ``POLICY_SETTINGS`` given a value other than their default that the chosen policy does not
        read, as ``model.aah.<key>=<value>``: unused, so never refused (one warning line says so)."""
        reads = self.reads()
        if reads is None:
            return []
        default = AAHConfig()
        return [
            line for name in POLICY_SETTINGS if name not in reads
            for line in _changed(f"model.aah.{name}", getattr(self, name), getattr(default, name))
        ]  # fmt: skip

    def resolved_candidates(self, seq_len: int) -> list[int]:
        """The candidate windows: ``candidates``, or ``[T/8, T/4, T/2, T]`` when it is not set or the policy does
        not read it (the windows it chooses from are then only reported)."""
        reads = self.reads()
        if self.candidates is None or (reads is not None and "candidates" not in reads):
            return sorted({max(1, seq_len // 8), max(1, seq_len // 4), max(1, seq_len // 2), seq_len})
        return list(self.candidates)

    def validate(self, seq_len: int, n_layer: int, n_head: int) -> None:
        """The shared settings, then the chosen policy's own (``WindowPolicy.validate``)."""
        self.validate_sink()
        policy = policy_class(self.policy)
        cands = self.resolved_candidates(seq_len)
        require(len(cands) > 0, "model.aah.candidates", self.candidates, "a non-empty list of window sizes")
        for c in cands:
            require(
                isinstance(c, int) and 0 < c <= seq_len,
                "model.aah.candidates",
                self.candidates,
                f"every window an integer in [1, seq_len={seq_len}] (bad entry {c!r})",
            )
        require(cands == sorted(set(cands)), "model.aah.candidates", self.candidates, "ascending, without repeats")
        policy.validate(self, seq_len, n_layer, n_head)
