"""Window diagnostics: a scheduler callback (``WindowDiagnostics``) and the small parts it runs, each with its tags.

A part knows what it logs, not when: ``WindowDiagnostics`` decides the steps (docs/tensorboard.md lists tags and
schedules). The parts read the window table from the planner's host mirror and the policy's ``PolicyReport``, so
none of them syncs with the device, except ``AttentionMassCoverage``, the one that runs the model.

=========================  ======================================================  ====================================
part                       tags                                                    when
=========================  ======================================================  ====================================
``TableScalars``           aah/acr, aah/causal_coverage, aah/block_density,        every ``every_n_steps`` and when the
                           aah/window_fraction/<W>, aah/window_change_rate,        table changes
                           aah/distinct_windows, aah/window_spread,
                           aah/levels_used, aah/groups/level_<k> (+ /layer_<l>)
``WindowHistograms``       aah/windows (+ /layer_<l>)                              with the scalars
``WindowMap``              aah/window_map                                          when the table or the policy's
``HierarchyText``          aah/hierarchy                                           decision changes (rate-limited)
``HeadWindows``            aah/head_window/layer_<l>/head_<h>                      with the scalars (``per_layer``)
``NeedScalars``            aah/need/layer_<l>/head_<h>/<W>                         at every decision of a policy that
                                                                                   measures need (``per_layer``)
``AttentionMassCoverage``  aah/attention_mass_coverage (+ /min_head, /layer_<l>)   every ``amc_every_n_steps``
=========================  ======================================================  ====================================
"""

from __future__ import annotations

import lightning as L
import torch
from torch import Tensor

from aah_lightning.data.batch import seq_len_of, split_batch
from aah_lightning.errors import require
from aah_lightning.lit.media import media_loggers
from aah_lightning.lit.throughput import host_window_table
from aah_lightning.windows import metrics
from aah_lightning.windows.policy_base import PolicyReport
from aah_lightning.windows.probe import mass_within, run_probe


def _log_scalars(trainer, values: dict[str, float], step: int) -> None:
    for logger in trainer.loggers:
        logger.log_metrics(values, step=step)


class TableScalars:
    """The scalars of one window table, model-wide and (``per_layer``) per layer; the policy's group counts."""

    tags = (
        "aah/acr",
        "aah/causal_coverage",
        "aah/block_density",
        "aah/window_fraction/<W>",
        "aah/window_change_rate",
        "aah/distinct_windows",
        "aah/window_spread",
        "aah/levels_used",
        "aah/groups/level_<k>",
    )

    def __init__(self, per_layer: bool = True, block_density: bool = True):
        self.per_layer = per_layer
        self.block_density = block_density

    def values(
        self, pl_module, table: Tensor, seq_len: int, report: PolicyReport, previous: Tensor | None = None
    ) -> dict[str, float]:
        sink = pl_module.model.sink  # ACR and causal coverage count the attention sink's pairs
        values = {
            "aah/acr": float(metrics.acr(table, seq_len, sink)),
            "aah/causal_coverage": float(metrics.causal_coverage(table, seq_len, sink)),
        }
        per_layer = {
            "aah/acr": metrics.layer_acr(table, seq_len, sink),
            "aah/causal_coverage": metrics.layer_causal_coverage(table, seq_len, sink),
            # Whether the heads of a layer really differ: 1 distinct window / spread 0 is one window for all.
            "aah/distinct_windows": metrics.layer_distinct_windows(table, seq_len),
            "aah/window_spread": metrics.layer_window_spread(table, seq_len),
        }
        for tag in ("aah/distinct_windows", "aah/window_spread"):
            values[tag] = sum(per_layer[tag]) / len(per_layer[tag])
        if self.block_density:
            density, _ = metrics.plan_block_density(
                self.plans_in_use(pl_module, seq_len), table, seq_len, pl_module.model.cfg.block_size, sink
            )
            values["aah/block_density"] = sum(density) / len(density)  # every layer has the same tile count
            per_layer["aah/block_density"] = density
        for w in metrics.fraction_windows(table, report.candidates):
            values[f"aah/window_fraction/{w}"] = float((table == w).to(torch.float64).mean())
        rate = metrics.change_rate(previous, table)
        if rate is not None:
            values["aah/window_change_rate"] = rate
        if report.trees is not None:
            levels, counts = metrics.group_stats(report.trees)
            with_tree = [n for n in levels if n > 0]
            values["aah/levels_used"] = sum(with_tree) / len(with_tree)
            per_layer["aah/levels_used"] = levels
            for k, mean in enumerate(metrics.mean_group_counts(counts)):
                values[f"aah/groups/level_{k}"] = mean
            if self.per_layer:
                for layer, c in enumerate(counts):
                    for k, n in enumerate(c):
                        values[f"aah/groups/level_{k}/layer_{layer}"] = float(n)
        if self.per_layer:
            for tag, layer_values in per_layer.items():
                for layer, v in enumerate(layer_values):
                    values[f"{tag}/layer_{layer}"] = float(v)
        return values

    @staticmethod
    def plans_in_use(pl_module, seq_len: int):
        """The training forward's plans, straight from the planner's cache (so nothing is built), or None where they
        depend on each batch (document masking): then the block density is the table's analytic tile count."""
        model = pl_module.model
        if model.cfg.document_mask:
            return [None] * model.cfg.n_layer
        with torch.enable_grad():  # the training backend, as the forward resolved it
            return model.attention_plans(seq_len)


class HeadWindows:
    """Every head's window as its own curve: when a head gains or loses reach, its curve steps."""

    tags = ("aah/head_window/layer_<l>/head_<h>",)

    @staticmethod
    def values(table: Tensor) -> dict[str, float]:
        return {
            f"aah/head_window/layer_{layer}/head_{head}": float(w)
            for layer, row in enumerate(table.tolist())
            for head, w in enumerate(row)
        }


class NeedScalars:
    """What decided each head's window: the policy's need signal for every candidate at its last decision (the mass
    share the window keeps, or the gain signal's loss decrease in nats; ``PolicyReport.need``)."""

    tags = ("aah/need/layer_<l>/head_<h>/<W>",)

    @staticmethod
    def values(report: PolicyReport) -> dict[str, float]:
        need = report.need.tolist()
        return {
            f"aah/need/layer_{layer}/head_{head}/{w}": float(v)
            for layer, heads in enumerate(need)
            for head, row in enumerate(heads)
            for w, v in zip(report.candidates, row)
        }


class WindowHistograms:
    """Histograms of the windows, of all heads and (``per_layer``) of each layer's heads."""

    tags = ("aah/windows", "aah/windows/layer_<l>")

    def __init__(self, per_layer: bool = True):
        self.per_layer = per_layer

    def log(self, media: list, table: Tensor, step: int) -> None:
        for sink in media:
            sink.histogram("aah/windows", table.flatten(), step)
            if self.per_layer:
                for layer, row in enumerate(table):
                    sink.histogram(f"aah/windows/layer_{layer}", row, step)


class WindowMap:
    """The image of the table: a layer per row, a head per column, coloured by window."""

    tags = ("aah/window_map",)

    def log(self, media: list, table: Tensor, step: int, seq_len: int, report: PolicyReport, sink: int = 0) -> None:
        from aah_lightning.windows import plots  # matplotlib: loaded only by runs that draw

        title = (
            f"step {step}: ACR {float(metrics.acr(table, seq_len, sink)):.3f}, "
            f"causal coverage {float(metrics.causal_coverage(table, seq_len, sink)):.3f}"
        )
        fig = plots.window_map_figure(table, seq_len, report.candidates, title)
        rgb = plots.figure_rgb(fig)
        for sink in media:
            sink.image("aah/window_map", rgb, step)


class HierarchyText:
    """The policy's hierarchy of head groups (or the heads' windows per layer) as text."""

    tags = ("aah/hierarchy",)

    def log(self, media: list, table: Tensor, step: int, report: PolicyReport) -> None:
        text = metrics.hierarchy_text(table, report.trees, report.last_step)
        for sink in media:
            sink.text("aah/hierarchy", text, step)


class AttentionMassCoverage:
    """Share of each head's full-causal attention mass inside its window, on a probe of the current batch.

    Its query sample continues across a resume (``state_dict``), so a resumed run logs what an uninterrupted one would.
    """

    tags = (
        "aah/attention_mass_coverage",
        "aah/attention_mass_coverage/min_head",
        "aah/attention_mass_coverage/layer_<l>",
    )

    def __init__(self, sequences: int = 1, queries: int = 32, seed: int = 0, per_layer: bool = True):
        self.sequences, self.queries, self.per_layer = sequences, queries, per_layer
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def measure(self, trainer, pl_module, batch) -> Tensor:
        """``[L, H]`` coverage; every rank runs it (under FSDP the forward gathers parameters from all of them)."""
        model = pl_module.model
        tokens, _, docs = split_batch(batch)
        with trainer.precision_plugin.forward_context():  # the training numerics (autocast under bf16-mixed)
            probe = run_probe(model, tokens, docs, self.sequences, self.queries, self.generator)
        return mass_within(probe, model.windows).double().cpu()

    def values(self, amc: Tensor) -> dict[str, float]:
        values = {
            "aah/attention_mass_coverage": float(amc.mean()),
            "aah/attention_mass_coverage/min_head": float(amc.min()),
        }
        if self.per_layer:
            for layer, row in enumerate(amc):
                values[f"aah/attention_mass_coverage/layer_{layer}"] = float(row.mean())
        return values


class WindowDiagnostics(L.Callback):
    """What the window table is and does, logged on rank 0: schedules the parts above. Scalars go to every logger;
    histograms, the map and the text to the loggers that show them (lit/media.py: TensorBoard, W&B), and are not
    computed when there is none (e.g. CSVLogger alone).

    Every ``every_n_steps`` optimizer steps and whenever the table changes: ``TableScalars`` and ``WindowHistograms``.
    At the first step and whenever the table or the policy's decision (``PolicyReport.last_step``) changes, at most
    once per ``visuals_min_interval``: ``WindowMap`` and ``HierarchyText``. Every ``amc_every_n_steps``:
    ``AttentionMassCoverage`` (the only diagnostic that runs the model).
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        per_layer: bool = True,
        block_density: bool = True,
        histograms: bool = True,
        window_map: bool = True,
        hierarchy: bool = True,
        visuals_min_interval: int = 50,
        amc_every_n_steps: int = 250,
        amc_sequences: int = 1,
        amc_queries: int = 32,
        amc_seed: int = 0,
    ):
        """
        Args:
            every_n_steps: log the table's scalars and histograms every this many optimizer steps (and on change).
            per_layer: also log per-layer scalars (``<tag>/layer_<l>``) and histograms.
            block_density: log ``aah/block_density`` (tiles of the BlockMasks in use, or the analytic count).
            histograms: log the histograms ``aah/windows``.
            window_map: log the image ``aah/window_map`` when the table changes.
            hierarchy: log the text ``aah/hierarchy`` when the table or the policy's decision changes.
            visuals_min_interval: at least this many steps between two window maps / hierarchy texts (drawing a map
                takes a noticeable fraction of a second; a change inside the interval is drawn as soon as it ends).
            amc_every_n_steps: log ``aah/attention_mass_coverage`` every this many steps (0 = never). It runs one
                no-grad forward of ``amc_sequences`` sequences on every rank, plus ``O(L*H*S*T)`` probe math.
            amc_sequences: sequences of the current batch the AMC probe reads.
            amc_queries: sampled query positions per sequence (stratified over the sequence).
            amc_seed: seed of the query sampling.
        """
        require(
            isinstance(every_n_steps, int) and every_n_steps >= 1,
            "diagnostics.every_n_steps",
            every_n_steps,
            "a positive number of steps",
        )
        require(
            isinstance(amc_every_n_steps, int) and amc_every_n_steps >= 0,
            "diagnostics.amc_every_n_steps",
            amc_every_n_steps,
            "0 (off) or a positive number of steps",
        )
        require(amc_sequences >= 1, "diagnostics.amc_sequences", amc_sequences, "at least 1")
        require(amc_queries >= 1, "diagnostics.amc_queries", amc_queries, "at least 1")
        require(
            isinstance(visuals_min_interval, int) and visuals_min_interval >= 1,
            "diagnostics.visuals_min_interval",
            visuals_min_interval,
            "a positive number of steps",
        )
        self.every_n_steps = every_n_steps
        self.visuals_min_interval = visuals_min_interval
        self.amc_every_n_steps = amc_every_n_steps
        self.scalars = TableScalars(per_layer, block_density)
        self.histograms = WindowHistograms(per_layer) if histograms else None
        self.window_map = WindowMap() if window_map else None
        self.hierarchy = HierarchyText() if hierarchy else None
        self.amc = AttentionMassCoverage(amc_sequences, amc_queries, amc_seed, per_layer)
        self.per_layer = per_layer
        self._need_step = None  # the policy decision whose need was last logged
        self._last_table = None  # the table at the last logged step
        self._last_step = None
        self._visual_key = None
        self._visual_step = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if not trainer.loggers or step == self._last_step:  # gradient accumulation: once per optimizer step
            return
        self._last_step = step
        seq_len = seq_len_of(batch)
        amc = None
        if self.amc_every_n_steps and step % self.amc_every_n_steps == 0:
            amc = self.amc.measure(trainer, pl_module, batch)  # on every rank
        if not trainer.is_global_zero:
            return
        table = host_window_table(pl_module)
        report = pl_module.policy.report()
        media = media_loggers(trainer)  # loggers that show histograms, images, text (none: scalars only)
        if self._last_table is None or not torch.equal(table, self._last_table) or step % self.every_n_steps == 0:
            values = self.scalars.values(pl_module, table, seq_len, report, self._last_table)
            if self.per_layer:
                values.update(HeadWindows.values(table))
            _log_scalars(trainer, values, step)
            if media and self.histograms is not None:
                self.histograms.log(media, table, step)
            self._last_table = table
        if media and self._visuals_due(table, report, step):
            if self.window_map is not None:
                self.window_map.log(media, table, step, seq_len, report, pl_module.model.sink)
            if self.hierarchy is not None:
                self.hierarchy.log(media, table, step, report)
        if self.per_layer and report.need is not None and report.last_step != self._need_step:
            _log_scalars(trainer, NeedScalars.values(report), step)
            self._need_step = report.last_step
        if amc is not None:
            _log_scalars(trainer, self.amc.values(amc), step)

    def _visuals_due(self, table: Tensor, report: PolicyReport, step: int) -> bool:
        """At the first step after the table or the policy's decision changed, but at most once per
        ``visuals_min_interval``: at a control interval of 5, drawing every change would cost more than the training.
        A change inside that spacing is drawn at the first step the spacing allows."""
        key = (tuple(table.flatten().tolist()), report.last_step)
        if key == self._visual_key:
            return False
        if self._visual_step is not None and step - self._visual_step < self.visuals_min_interval:
            return False
        self._visual_key, self._visual_step = key, step
        return True

    # A resumed run logs what an uninterrupted one would: the probe's query sample continues, and the step already
    # logged before the checkpoint is not logged again from the next step's first micro-batch.
    def state_dict(self) -> dict:
        return {
            "amc_generator": self.amc.generator.get_state(),
            "last_step": self._last_step,
            "need_step": -1 if self._need_step is None else self._need_step,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if "amc_generator" in state_dict:  # optional: without it the sample restarts from the seed
            self.amc.generator.set_state(state_dict["amc_generator"])
            self._last_step = state_dict["last_step"]
        need = state_dict.get("need_step", -1)
        self._need_step = None if need < 0 else need
