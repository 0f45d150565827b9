"""DataPosition, the one owner of the training position: the global order, accumulation, the resume check and the
restatement of Lightning's restored micro-batch counts."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
import pytest

from aah_lightning.errors import ConfigError
from aah_lightning.lit.data_position import DataPosition, global_batch


def _trainer(world=1, rank=0, acc=1, step=0, max_steps=10):
    return SimpleNamespace(
        world_size=world,
        global_rank=rank,
        accumulate_grad_batches=acc,
        global_step=step,
        max_steps=max_steps,
        max_epochs=None,
        current_epoch=0,
        limit_train_batches=1.0,
    )


def _blocks_of_step(world, batch, acc, step, n=64):
    """The blocks all ranks read in optimizer step ``step`` (as a set), from samplers started at that step."""
    position = DataPosition("stdlib", seed=7, batch_size=batch, global_batch_size=None, num_workers=0)
    seen = set()
    for rank in range(world):
        trainer = _trainer(world, rank, acc, step)
        layout = position.layout(trainer, n)
        sampler = iter(position.sampler(trainer, n, layout))
        seen |= {next(sampler) for _ in range(batch * acc)}
    return seen


def test_a_step_reads_the_same_blocks_on_any_split_of_the_global_batch():
    # Global batch 8: one process x 8, two x 4, two x 2 x accumulation 2, four x 1 x accumulation 2.
    for step in (0, 3):
        reference = _blocks_of_step(1, 8, 1, step)
        assert len(reference) == 8
        for world, batch, acc in ((2, 4, 1), (2, 2, 2), (4, 1, 2)):
            assert _blocks_of_step(world, batch, acc, step) == reference
    assert _blocks_of_step(1, 8, 1, 0) != _blocks_of_step(1, 8, 1, 1)


def test_accumulation_follows_the_global_batch_and_refuses_what_does_not_divide():
    position = DataPosition("stdlib", 0, batch_size=4, global_batch_size=32, num_workers=0)
    trainer = _trainer(world=2)
    position.resolve_accumulation(trainer)
    assert trainer.accumulate_grad_batches == 4
    position.resolve_accumulation(trainer)  # idempotent
    assert trainer.accumulate_grad_batches == 4
    with pytest.raises(ConfigError, match=r"data.global_batch_size=32 .* a multiple of 12"):
        position.resolve_accumulation(_trainer(world=3))


def test_a_resume_with_another_global_batch_is_refused_with_the_fix():
    saved = DataPosition("stdlib", 0, 4, None, 0).layout(_trainer(world=2, acc=2), 100)
    assert global_batch(saved) == 16
    now = DataPosition("stdlib", 0, 4, None, 0).layout(_trainer(world=1), 100)
    with pytest.raises(ConfigError, match=r"global batch of 16 blocks .* set data.global_batch_size=16"):
        DataPosition("stdlib", 0, 4, None, 0).check_resume(saved, now)
    DataPosition("stdlib", 0, 4, None, 0).check_resume(
        saved, DataPosition("stdlib", 0, 4, None, 0).layout(_trainer(world=1, acc=4), 100)
    )


def test_restating_the_batch_count_moves_lightnings_counters_once():
    # A checkpoint of 3 optimizer steps at accumulation 2 (6 micro-batches), resumed at accumulation 4.
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.accumulate_grad_batches = 4
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for counter in (progress.current, progress.total):
        counter.ready = counter.started = counter.processed = counter.completed = 6
    position = DataPosition("stdlib", 0, 2, 8, 0)
    saved = {"layout": position.layout(_trainer(world=2, acc=2), 100)}
    position.restore(saved, position.layout(_trainer(world=1, acc=4), 100))
    position.restate_batch_count(trainer)
    position.restate_batch_count(trainer)  # once per restore
    for counter in (progress.current, progress.total):
        assert (counter.ready, counter.started, counter.processed, counter.completed) == (12, 12, 12, 12)


def test_a_count_from_inside_an_accumulation_window_is_left_alone():
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.accumulate_grad_batches = 4
    progress = trainer.fit_loop.epoch_loop.batch_progress
    progress.current.ready = progress.total.ready = 5  # not a step boundary of accumulation 2
    position = DataPosition("stdlib", 0, 2, 8, 0)
    position.restore({"layout": position.layout(_trainer(world=2, acc=2), 100)}, position.layout(_trainer(acc=4), 100))
    position.restate_batch_count(trainer)
    assert progress.current.ready == progress.total.ready == 5


def test_stream_positions_are_kept_per_worker_and_dropped_from_the_batch():
    position = DataPosition("hub", 0, 2, None, 2, streamed=True)
    batch = {"tokens": 1, "resume": ['{"worker": 0, "doc": 3}', '{"worker": 1, "doc": 5}', '{"worker": 0, "doc": 4}']}
    assert position.record(batch) and "resume" not in batch
    assert position.streams == {"0": {"doc": 4}, "1": {"doc": 5}}
    assert not position.record({"tokens": 1})
    position.restored = {"streams": [{"0": {"doc": 9}}, {"0": {"doc": 11}}]}
    assert position.restored_stream(1, 2) == {"0": {"doc": 11}}
    with pytest.raises(ConfigError, match="stream positions of 2 processes, this run has 3"):
        position.restored_stream(0, 3)


def test_the_position_is_built_from_the_data_config():
    from aah_lightning.data.config import DataConfig
    from aah_lightning.lit.datamodule import TextDataModule

    config = DataConfig(source="hub", seed=5, batch_size=3, global_batch_size=12, num_workers=2)
    position = DataPosition.from_config(config, streamed=True)
    assert (position.source, position.seed, position.batch_size) == ("hub", 5, 3)
    assert (position.global_batch_size, position.num_workers, position.streamed) == (12, 2, True)
    assert position.layout(None, None)["num_workers"] == 2  # a stream's readers are part of its layout
    dm = TextDataModule(source="synthetic", seq_len=16, batch_size=2, seed=9, synthetic={"documents": 30})
    assert not dm.streamed and not dm.position.streamed
    assert (dm.position.seed, dm.position.batch_size) == (9, 2)
