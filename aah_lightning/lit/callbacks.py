"""Callbacks that observe training: throughput / MFU and window diagnostics (tags: docs/tensorboard.md).

Nothing here syncs with the device on the training hot path. The window table is read from the attention planner's
host mirror (read back only when the table changed, which the forward has already done); everything else runs at
log steps, diagnostic steps or when the table changes.
"""

from __future__ import annotations

import time
import warnings
from typing import Optional

import lightning as L
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

from aah_lightning.aah import diagnostics as diag
from aah_lightning.aah import metrics
from aah_lightning.aah.probe import mass_within, run_probe
from aah_lightning.errors import require
from aah_lightning.lit import flops


def host_rows(pl_module) -> list[tuple[int, ...]]:
    """The window table as rows of ints, from the planner's host mirror (the same list until the table changes)."""
    model = pl_module.model
    return model.planner.rows(model.windows)


def host_window_table(pl_module) -> torch.Tensor:
    """The window table as a CPU int64 tensor, from the planner's host mirror."""
    return torch.tensor(host_rows(pl_module), dtype=torch.int64)


def tensorboard(trainer) -> TensorBoardLogger | None:
    return next((lg for lg in trainer.loggers if isinstance(lg, TensorBoardLogger)), None)


def compute_dtype(precision) -> torch.dtype:
    """The matmul dtype of a Lightning precision setting ("bf16-mixed" -> bfloat16, "32-true" -> float32, ...)."""
    p = str(precision)
    if p.startswith("bf16"):
        return torch.bfloat16
    if p.startswith("16") or p.startswith("transformer-engine"):
        return torch.float16
    if p.startswith("64"):
        return torch.float64
    return torch.float32


def default_peak_flops(device: torch.device, precision) -> float | None:
    """Dense peak FLOP/s of one CUDA device at the training precision: the table of current GPUs in lit/flops.py,
    then Lightning's table for older ones. None on other devices or a GPU neither knows."""
    if device.type != "cuda":
        return None
    dtype = compute_dtype(precision)
    peak = flops.peak_flops(torch.cuda.get_device_name(device), dtype, torch.get_float32_matmul_precision())
    if peak is not None:
        return peak
    from lightning.fabric.utilities.throughput import get_available_flops

    with warnings.catch_warnings():  # Throughput says it once, in its own words
        warnings.simplefilter("ignore")
        peak = get_available_flops(device, dtype)
    return None if peak is None else float(peak)


class Throughput(L.Callback):
    """``perf/tokens_per_sec``, ``perf/flops_per_sec`` and ``perf/mfu``.

    Training tokens and window-aware training FLOPs (lit/flops.py: 6 x matmul weights per token plus 12 x head_dim
    per causal in-window attention pair) of all ranks, per second of training wall time, measured over ``window``
    batches and excluding validation. ``perf/mfu`` = FLOP/s / (``peak_flops`` x world size). Wall-clock intervals need
    no per-step device sync: queued work is bounded, so the long-run rate is exact.
    """

    def __init__(self, window: int = 10, peak_flops: Optional[float] = None):
        """
        Args:
            window: batches per measurement.
            peak_flops: peak FLOP/s of one device, the denominator of perf/mfu. Default: on CUDA, the dense peak of
                the GPU at the training precision (lit/flops.py PEAK_FLOPS for H100, H200, B200; Lightning's table
                for older GPUs); on CPU, or a GPU neither knows, perf/mfu is not logged and one warning says so.
        """
        require(isinstance(window, int) and window >= 1, "throughput.window", window, "a positive number of batches")
        require(peak_flops is None or peak_flops > 0, "throughput.peak_flops", peak_flops, "a positive FLOP/s or null")
        self.window = window
        self.peak_flops = peak_flops
        self.peak = None  # the resolved denominator of perf/mfu
        self._flops_key = None
        self._flops_per_seq = 0
        self._reset()

    def _reset(self):
        self._t0 = None
        self._tokens = 0
        self._flops = 0
        self._steps = 0
        self.tokens_per_sec = None
        self.flops_per_sec = None
        self.mfu = None

    def on_train_start(self, trainer, pl_module):
        self._reset()
        if self.peak_flops is not None:
            self.peak = float(self.peak_flops)
        else:
            self.peak = default_peak_flops(pl_module.device, trainer.precision)
            if self.peak is None:
                device = pl_module.device
                name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
                rank_zero_warn(
                    f"perf/mfu is not logged: no peak FLOP/s is known for {name} at precision {trainer.precision}; "
                    f"set throughput.peak_flops (FLOP/s of one device) to log it"
                )

    def sequence_flops(self, pl_module, seq_len: int) -> int:
        """Training FLOPs of one sequence under the current table (recounted only when the table changes)."""
        rows = host_rows(pl_module)
        if self._flops_key is None or self._flops_key[0] is not rows or self._flops_key[1] != seq_len:
            self._flops_per_seq = flops.training_flops(pl_module.model.cfg, rows, seq_len)
            self._flops_key = (rows, seq_len)
        return self._flops_per_seq

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        tokens = batch["tokens"]
        batch_size, seq_len = tokens.shape[0], tokens.shape[1] - 1
        self._tokens += seq_len * batch_size * trainer.world_size
        self._flops += self.sequence_flops(pl_module, seq_len) * batch_size * trainer.world_size
        self._steps += 1
        if self._steps >= self.window:
            if tokens.is_cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            elapsed = max(now - self._t0, 1e-9)
            self.tokens_per_sec = self._tokens / elapsed
            self.flops_per_sec = self._flops / elapsed
            if self.peak:
                self.mfu = self.flops_per_sec / (self.peak * trainer.world_size)
            self._t0, self._tokens, self._flops, self._steps = now, 0, 0, 0
        if self.tokens_per_sec is not None:
            pl_module.log("perf/tokens_per_sec", self.tokens_per_sec, prog_bar=True, on_step=True, on_epoch=False)
            pl_module.log("perf/flops_per_sec", self.flops_per_sec, on_step=True, on_epoch=False)
            if self.mfu is not None:
                pl_module.log("perf/mfu", self.mfu, on_step=True, on_epoch=False)

    def on_validation_start(self, trainer, pl_module):
        self._t0, self._tokens, self._flops, self._steps = None, 0, 0, 0  # restart the window after validation


class WindowDiagnostics(L.Callback):
    """What the window table is and does, logged to TensorBoard on rank 0 (tags: docs/tensorboard.md).

    Every ``every_n_steps`` optimizer steps and whenever the table changes: ``aah/acr``, ``aah/causal_coverage``,
    ``aah/block_density``, ``aah/window_fraction/<W>``, ``aah/window_change_rate``, the policy's group counts and
    hierarchy levels, per-layer values, and the histograms ``aah/windows``. At the first step and whenever the table
    or the policy's decision (``policy.last_step``) changes, at most once per ``every_n_steps``: the image
    ``aah/window_map`` and the text ``aah/hierarchy``. Every ``amc_every_n_steps``: the attention-mass coverage from a small probe of the current
    batch (the only diagnostic that runs the model).
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
            visuals_min_interval: at least this many steps between two window maps / hierarchy texts (a map costs
                ~0.5 s to draw; a change inside the interval is drawn as soon as it ends).
            amc_every_n_steps: log ``aah/attention_mass_coverage`` every this many steps (0 = never). It runs one
                no-grad forward of ``amc_sequences`` sequences on every rank, plus ``O(L*H*S*T)`` probe math.
            amc_sequences: sequences of the current batch the AMC probe reads.
            amc_queries: sampled query positions per sequence (stratified over the sequence).
            amc_seed: seed of the query sampling.
        """
        require(isinstance(every_n_steps, int) and every_n_steps >= 1, "diagnostics.every_n_steps", every_n_steps,
                "a positive number of steps")
        require(isinstance(amc_every_n_steps, int) and amc_every_n_steps >= 0, "diagnostics.amc_every_n_steps",
                amc_every_n_steps, "0 (off) or a positive number of steps")
        require(amc_sequences >= 1, "diagnostics.amc_sequences", amc_sequences, "at least 1")
        require(amc_queries >= 1, "diagnostics.amc_queries", amc_queries, "at least 1")
        self.every_n_steps = every_n_steps
        self.per_layer = per_layer
        self.block_density = block_density
        self.histograms = histograms
        self.window_map = window_map
        self.hierarchy = hierarchy
        require(isinstance(visuals_min_interval, int) and visuals_min_interval >= 1, "diagnostics.visuals_min_interval",
                visuals_min_interval, "a positive number of steps")
        self.visuals_min_interval = visuals_min_interval
        self.amc_every_n_steps = amc_every_n_steps
        self.amc_sequences = amc_sequences
        self.amc_queries = amc_queries
        self.amc_seed = amc_seed
        self._generator = torch.Generator().manual_seed(amc_seed)
        self._last_table = None  # the table at the last logged step
        self._last_step = None
        self._visual_key = None
        self._visual_step = None
        self.block_density_sources: list[str] = []  # per layer: "blockmask" or "analytic", at the last log

    # -- when -----------------------------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if not trainer.loggers or step == self._last_step:  # gradient accumulation: once per optimizer step
            return
        self._last_step = step
        seq_len = batch["tokens"].shape[1] - 1
        amc = None
        if self.amc_every_n_steps and step % self.amc_every_n_steps == 0:
            # Every rank runs the probe: under FSDP the forward gathers parameters from all of them.
            amc = self.attention_mass_coverage(trainer, pl_module, batch)
        if not trainer.is_global_zero:
            return
        table = host_window_table(pl_module)
        changed = self._last_table is None or not torch.equal(table, self._last_table)
        if changed or step % self.every_n_steps == 0:
            self.log_table(trainer, pl_module, table, step, seq_len)
        tb = tensorboard(trainer)
        if tb is not None:
            self.log_visuals(tb, pl_module, table, step, seq_len)
        if amc is not None:
            self.log_amc(trainer, amc, step)

    # -- checkpoint ------------------------------------------------------------------------------------------------
    # A resumed run logs what an uninterrupted one would: the probe's query sample continues, and the step already
    # logged before the checkpoint is not logged again from the next step's first micro-batch.
    def state_dict(self) -> dict:
        return {"amc_generator": self._generator.get_state(), "last_step": self._last_step}

    def load_state_dict(self, state_dict: dict) -> None:
        if "amc_generator" in state_dict:  # checkpoints written before it was saved: the sample restarts from the seed
            self._generator.set_state(state_dict["amc_generator"])
            self._last_step = state_dict["last_step"]

    # -- what -----------------------------------------------------------------------------------------------------
    def table_scalars(self, pl_module, table: torch.Tensor, seq_len: int) -> dict[str, float]:
        """The scalars of one table (model-wide and, with ``per_layer``, per layer)."""
        values = {
            "aah/acr": float(metrics.acr(table, seq_len)),
            "aah/causal_coverage": float(metrics.causal_coverage(table, seq_len)),
        }
        per_layer = {
            "aah/acr": diag.layer_acr(table, seq_len),
            "aah/causal_coverage": diag.layer_causal_coverage(table, seq_len),
        }
        if self.block_density:
            density, self.block_density_sources = diag.plan_block_density(
                self.plans_in_use(pl_module, seq_len), table, seq_len, pl_module.model.cfg.block_size
            )
            values["aah/block_density"] = sum(density) / len(density)  # every layer has the same tile count
            per_layer["aah/block_density"] = density
        candidates = getattr(getattr(pl_module, "policy", None), "candidates", None) or []
        for w in diag.fraction_windows(table, candidates):
            values[f"aah/window_fraction/{w}"] = float((table == w).to(torch.float64).mean())
        rate = diag.change_rate(self._last_table, table)
        if rate is not None:
            values["aah/window_change_rate"] = rate
        trees = diag.group_trees(getattr(pl_module, "policy", None), table.shape[0])
        if trees is not None:
            levels, counts = diag.group_stats(trees)
            with_tree = [n for n in levels if n > 0]
            values["aah/levels_used"] = sum(with_tree) / len(with_tree)
            per_layer["aah/levels_used"] = levels
            for k, mean in enumerate(diag.mean_group_counts(counts)):
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

    def plans_in_use(self, pl_module, seq_len: int):
        """The training forward's plans, straight from the planner's cache (so nothing is built), or None where they
        depend on each batch (document masking): then the block density is the table's analytic tile count."""
        model = pl_module.model
        if model.cfg.document_mask:
            return [None] * model.cfg.n_layer
        with torch.enable_grad():  # the training backend, as the forward resolved it
            return model.attention_plans(seq_len)

    def log_table(self, trainer, pl_module, table: torch.Tensor, step: int, seq_len: int) -> None:
        values = self.table_scalars(pl_module, table, seq_len)
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)
        tb = tensorboard(trainer)
        if tb is not None:
            if self.histograms:
                tb.experiment.add_histogram("aah/windows", table.flatten(), global_step=step)
                if self.per_layer:
                    for layer, row in enumerate(table):
                        tb.experiment.add_histogram(f"aah/windows/layer_{layer}", row, global_step=step)
        self._last_table = table

    def log_visuals(self, tb, pl_module, table, step: int, seq_len: int) -> None:
        """Window map and hierarchy text, at the first step after the table or the policy's decision changed - but at
        most once per ``every_n_steps``: drawing the map costs ~0.5 s, which at a control interval of 5 would cost more
        than the training. A change inside that spacing is drawn at the first step the spacing allows."""
        policy = getattr(pl_module, "policy", None)
        key = (tuple(table.flatten().tolist()), diag.decision_step(policy))
        if key == self._visual_key:
            return
        if self._visual_step is not None and step - self._visual_step < self.visuals_min_interval:
            return
        self._visual_key, self._visual_step = key, step
        if self.window_map:
            from aah_lightning.aah import plots

            title = (
                f"step {step}: ACR {float(metrics.acr(table, seq_len)):.3f}, "
                f"causal coverage {float(metrics.causal_coverage(table, seq_len)):.3f}"
            )
            fig = plots.window_map_figure(table, seq_len, getattr(policy, "candidates", None) or [], title)
            tb.experiment.add_image("aah/window_map", plots.figure_rgb(fig), global_step=step, dataformats="HWC")
        if self.hierarchy:
            text = diag.hierarchy_text(table, diag.group_trees(policy, table.shape[0]), diag.decision_step(policy))
            # Indented four spaces: TensorBoard renders the text as markdown, and this keeps it a preformatted block.
            tb.experiment.add_text("aah/hierarchy", "\n".join("    " + line for line in text.splitlines()), step)

    @torch.no_grad()
    def attention_mass_coverage(self, trainer, pl_module, batch) -> torch.Tensor:
        """``[L, H]`` share of each head's full-causal attention mass inside its window, on a probe of the batch."""
        model = pl_module.model
        tokens = batch["tokens"][:, :-1]
        docs = batch.get("doc_ids")
        docs = None if docs is None else docs[:, :-1]
        with trainer.precision_plugin.forward_context():  # the training numerics (autocast under bf16-mixed)
            probe = run_probe(model, tokens, docs, self.amc_sequences, self.amc_queries, self._generator)
        return mass_within(probe, model.windows).double().cpu()

    def log_amc(self, trainer, amc: torch.Tensor, step: int) -> None:
        values = {
            "aah/attention_mass_coverage": float(amc.mean()),
            "aah/attention_mass_coverage/min_head": float(amc.min()),
        }
        if self.per_layer:
            for layer, row in enumerate(amc):
                values[f"aah/attention_mass_coverage/layer_{layer}"] = float(row.mean())
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)
