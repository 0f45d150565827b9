"""Where training stands in the data: the one owner of the training position and of Lightning's loop counters.

``DataPosition`` holds every piece of arithmetic that turns "this run has taken N optimizer steps" into "these are the
blocks it reads next", and every check of whether a checkpoint's position can be continued:

- the seeded global order of map-style blocks (``sampler``: an ``EndlessSampler`` started at the position);
- global batch -> accumulation (``resolve_accumulation``), the one place ``trainer.accumulate_grad_batches`` is set;
- the layout a checkpoint's position is expressed in, and the resume check against it (``layout``, ``check_resume``);
- the loader's length Lightning expects and the run's planned steps (``steps_per_epoch``, ``planned_steps``);
- the restatement of Lightning's restored micro-batch counts after a change of accumulation (``restate_batch_count``):
  the only code in the package that writes Lightning's loop counters (``tests/lit/test_lightning_contract.py`` pins
  the Lightning behaviour it relies on);
- streamed sources' per-worker positions (``record``, ``stream_state``, ``restore_stream``).

A map-style position needs no entry in the checkpoint: it is ``global_step x global batch`` blocks of the global order,
whatever the world size, so it follows from the layout and Lightning's restored loop state.
"""

from __future__ import annotations

import json
import math

from lightning.pytorch.utilities import rank_zero_warn

from aah_lightning.data.config import DataConfig
from aah_lightning.data.packing import EndlessSampler
from aah_lightning.errors import ConfigError
from aah_lightning.lit.distributed import gather

# The layout entries a resume may change as long as the global batch stays the same.
FREE_LAYOUT = ("world_size", "batch_size", "accumulate_grad_batches")


def global_batch(layout: dict) -> int:
    """Blocks per optimizer step over all ranks, of a data layout (``DataPosition.layout``, or a checkpoint's)."""
    return layout["batch_size"] * layout["world_size"] * layout["accumulate_grad_batches"]


class DataPosition:
    """The training position of one data module (``source``, ``seed``, ``batch_size``, ``global_batch_size`` and
    ``num_workers`` are its settings, ``from_config`` takes them from its ``DataConfig``; ``streamed``: the source's
    training split positions itself, per worker);
    ``trainer`` is passed to every call that reads it (None: the module is used on its own, at position 0 on one
    process)."""

    def __init__(
        self,
        source: str,
        seed: int,
        batch_size: int,
        global_batch_size: int | None,
        num_workers: int,
        streamed: bool = False,
    ):
        self.source, self.streamed, self.seed, self.batch_size = source, streamed, seed, batch_size
        self.global_batch_size, self.num_workers = global_batch_size, num_workers
        self.restored: dict | None = None  # the data state of the checkpoint being resumed
        self.checked_layout: dict | None = None  # a saved layout the CLI's preflight already checked
        self._counts_restated = False  # Lightning's batch count restated for the restored layout (once)
        self.streams: dict = {}  # {worker id: position after the last block trained on} (streamed sources)

    @classmethod
    def from_config(cls, config: DataConfig, streamed: bool) -> DataPosition:
        """The position of data with settings ``config`` (``data.*``); ``streamed``: the one fact the settings do not
        hold, whether the source's training split is a stream (``is_stream``)."""
        return cls(
            config.source, config.seed, config.batch_size, config.global_batch_size, config.num_workers, streamed
        )

    # -- the global batch ------------------------------------------------------------------------------------------
    def resolve_accumulation(self, trainer) -> None:
        """With ``data.global_batch_size``: set ``trainer.accumulate_grad_batches`` to global / (batch x world size).

        Called before training starts (the CLI's preflight, and the data module's ``setup('fit')``); Lightning's loops
        read ``trainer.accumulate_grad_batches`` at every batch, so setting it here is enough. Idempotent."""
        total = self.global_batch_size
        if total is None:
            return
        batch, world = self.batch_size, trainer.world_size
        round_ = batch * world  # blocks of one micro-batch on every rank
        if total % round_:
            near = sorted({max(round_, total // round_ * round_), (total // round_ + 1) * round_})
            raise ConfigError(
                f"data.global_batch_size={total} is not allowed with data.batch_size={batch} on {world} process(es): "
                f"a multiple of {round_} (data.batch_size x processes), e.g. {' or '.join(map(str, near))}"
            )
        acc, given = total // round_, trainer.accumulate_grad_batches
        if given not in (1, acc):
            raise ConfigError(
                f"trainer.accumulate_grad_batches={given} is not allowed with data.global_batch_size={total}: it "
                f"follows from it ({total} / (data.batch_size={batch} x {world} processes) = {acc}); leave "
                f"trainer.accumulate_grad_batches at 1, or unset data.global_batch_size"
            )
        trainer.accumulate_grad_batches = acc

    # -- the layout and the resume check ---------------------------------------------------------------------------
    def layout(self, trainer, train_blocks: int | None) -> dict:
        """What the position means. A map-style position is global: it continues on another world size, batch size
        and accumulation as long as their product (the global batch) is the same; a stream's needs the same
        processes and workers too (``check_resume``). ``train_blocks``: the permuted training blocks (map-style)."""
        layout = {
            "source": self.source,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "accumulate_grad_batches": trainer.accumulate_grad_batches if trainer else 1,
            "world_size": trainer.world_size if trainer else 1,
            "num_workers": self.num_workers if self.streamed else 0,
        }
        if train_blocks is not None:
            layout["train_blocks"] = train_blocks
        return layout

    def check_resume(self, saved: dict, now: dict) -> None:
        """Refuse, in one line, a resume this data cannot continue: another global batch, or a stream read by
        another number of processes or workers. ``saved``: the checkpoint's layout; ``now``: this run's."""
        old, new = global_batch(saved), global_batch(now)
        if old != new:
            batch, world = now["batch_size"], now["world_size"]
            if old % (batch * world) == 0:
                fix = f"set data.global_batch_size={old} (or trainer.accumulate_grad_batches={old // (batch * world)})"
            elif old % world == 0:
                fix = f"set data.batch_size to a divisor of {old // world} and data.global_batch_size={old}"
            else:
                fix = f"use a number of processes that divides {old}, and data.global_batch_size={old}"
            raise ConfigError(
                f"the checkpoint was trained with a global batch of {old} blocks (data.batch_size="
                f"{saved['batch_size']} x {saved['world_size']} processes x trainer.accumulate_grad_batches="
                f"{saved['accumulate_grad_batches']}), this run's is {new} ({batch} x {world} x "
                f"{now['accumulate_grad_batches']}): {fix} to resume it"
            )
        if self.streamed and saved.get("source") == now["source"]:
            readers = (saved["world_size"], saved["num_workers"])
            if readers != (now["world_size"], now["num_workers"]):
                raise ConfigError(
                    f"the checkpoint holds stream positions of {readers[0]} process(es) with data.num_workers="
                    f"{readers[1]}, this run has {now['world_size']} with {now['num_workers']}: positions in the "
                    f"shards of a stream cannot be moved to another split without repeating or skipping documents; "
                    f"resume on {readers[0]} process(es) with data.num_workers={readers[1]}, or start a new run"
                )

    def restore(self, state: dict, now: dict) -> None:
        """Take a resumed fit's data state (checked against this run's layout ``now``); warns where a setting that
        changes the batches (seed, source, training blocks) differs."""
        self.restored, self._counts_restated = state, False
        if state["layout"] != self.checked_layout:  # not checked before (code driving a Trainer directly)
            self.check_resume(state["layout"], now)
        changed = {k: (v, now.get(k)) for k, v in state["layout"].items() if k not in FREE_LAYOUT and now.get(k) != v}
        if changed:
            rank_zero_warn(
                "resuming with another data layout ("
                + ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items())
                + "): training continues, but not with the batches the interrupted run would have seen"
            )

    # -- map-style position ----------------------------------------------------------------------------------------
    def steps_per_epoch(self, trainer, train_blocks: int, layout: dict) -> int:
        """Optimizer steps of one training epoch of an epoch-based run (map-style data).

        An epoch is one seeded permutation of the training blocks in whole global batches: ``n // global_batch``
        steps; the last ``n mod global_batch`` blocks of each permutation are left out of that epoch. With
        ``trainer.limit_train_batches``, Lightning's cut of the epoch (it steps on the last batch)."""
        total = global_batch(layout)
        steps = train_blocks // total
        if steps == 0:
            raise ConfigError(
                f"the {train_blocks} training blocks are fewer than one global batch of {total} "
                f"(data.batch_size x processes x trainer.accumulate_grad_batches): an epoch-based run "
                f"(trainer.max_steps=-1) needs at least one; use more data or a smaller batch"
            )
        acc = trainer.accumulate_grad_batches
        batches, limit = steps * acc, getattr(trainer, "limit_train_batches", 1.0)
        if isinstance(limit, int):
            batches = min(batches, limit)
        elif limit != 1.0:
            batches = int(batches * limit)
        return math.ceil(batches / acc)

    def planned_steps(self, trainer, train_blocks: int | None, layout: dict) -> int | None:
        """The run's optimizer steps (for the learning-rate schedule), known before the train loader is built, so
        that Lightning does not build it before a resumed run's loop state is restored. None: ask Lightning (a
        stream, or an open-ended run)."""
        if trainer is None or train_blocks is None:
            return None
        if trainer.max_steps > 0:
            return trainer.max_steps
        if trainer.max_epochs is None or trainer.max_epochs < 0:
            return None
        return self.steps_per_epoch(trainer, train_blocks, layout) * max(trainer.max_epochs, 1)

    def _map_position(self, trainer, train_blocks: int, layout: dict) -> tuple[int, int, int | None]:
        """(global positions consumed, items this rank's loader must hold, positions per epoch or None).

        The position is in global terms: ``global_step x global batch`` blocks of the global order
        (``EndlessSampler``), whatever the world size; it follows from the restored loop state at optimizer-step
        boundaries (where checkpoints are written). The loader's length is what Lightning expects of it: on a resume
        it restores its batch count and stops after ``len - count`` batches, so the loader keeps the length of the
        uninterrupted run while its sampler starts at the position.
        """
        if trainer is None:
            return 0, train_blocks, None
        acc, total = trainer.accumulate_grad_batches, global_batch(layout)
        if trainer.max_steps > 0:  # step-based: one Lightning epoch spans the whole run
            return trainer.global_step * total, trainer.max_steps * self.batch_size * acc, None
        # Epoch-based: epoch e is permutation e in whole global batches (steps_per_epoch).
        whole = train_blocks // total  # steps of an epoch without limit_train_batches
        steps, epoch = self.steps_per_epoch(trainer, train_blocks, layout), trainer.current_epoch
        done = min(steps, max(0, trainer.global_step - epoch * steps))
        return epoch * whole * total + done * total, whole * self.batch_size * acc, whole * total

    def sampler(self, trainer, train_blocks: int, layout: dict) -> EndlessSampler:
        """This rank's sampler of the seeded global order, started at the training position."""
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        start, length, per_epoch = self._map_position(trainer, train_blocks, layout)
        return EndlessSampler(
            train_blocks,
            self.seed,
            length=max(0, length),
            rank=rank,
            world_size=world,
            start=start,
            per_epoch=per_epoch,
            epochs=per_epoch is not None,
        )

    def restate_batch_count(self, trainer) -> None:
        """On a resume with another accumulation (the same global batch on another world size), restate Lightning's
        restored count of this epoch's micro-batches in the new accumulation: it decides where optimizer steps fall
        and when the loader is exhausted. Once per restore; called when the training loader is built, after
        Lightning has restored its loops."""
        saved = (self.restored or {}).get("layout")
        loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if saved is None or loop is None or self._counts_restated:
            return
        self._counts_restated = True
        old, new = saved["accumulate_grad_batches"], trainer.accumulate_grad_batches
        if old == new:
            return
        for progress in (loop.batch_progress.current, loop.batch_progress.total):
            steps, within = divmod(progress.ready, old)
            if within:  # a checkpoint from inside an accumulation window: no step boundary to restate
                continue
            shift = steps * (new - old)
            progress.ready += shift
            progress.started += shift
            progress.processed += shift
            progress.completed += shift

    # -- streamed sources ------------------------------------------------------------------------------------------
    def record(self, batch) -> bool:
        """Keep the positions a streamed training batch carries (the last one per worker) and drop them from the
        batch; True when there were any."""
        if not (isinstance(batch, dict) and "resume" in batch):
            return False
        for text in batch.pop("resume"):
            position = json.loads(text)
            self.streams[str(position.pop("worker"))] = position
        return True

    def stream_state(self) -> list:
        """Every rank's stream positions, gathered (called on every rank when a checkpoint is written)."""
        return gather(dict(self.streams))

    def restored_stream(self, rank: int, world: int) -> dict | None:
        """This rank's restored stream position, or None when the checkpoint holds none."""
        streams = (self.restored or {}).get("streams")
        if streams is None:
            return None
        if len(streams) != world:  # check_resume refuses this before; a stream restarted here would repeat data
            raise ConfigError(
                f"the checkpoint holds stream positions of {len(streams)} processes, this run has {world}"
            )
        self.streams = dict(streams[rank])
        return dict(streams[rank])
