"""``model.init_from`` on two processes (gloo, CPU) under DDP and FSDP2: both ranks start from the source's weights
(FSDP2 shards the loaded model) and the controller decides the same table on both at step 0 and after; the sharded
checkpoint folder FSDP2 writes is itself a source."""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

from aah_lightning import retrofit
from aah_lightning.cli import main
from helpers.distributed import DDP, FSDP2, fit
from helpers.resume import read_run

pytestmark = pytest.mark.heavy  # every test here starts processes

RETROFIT = [
    "--model.aah.policy=adaptive",
    "--model.aah.controller.schedule.warmup_steps=0",
    "--model.aah.controller.schedule.control_interval=3",  # steps 0 and 3
    "--model.aah.controller.need.signal=gain",
    "--model.aah.controller.budget.target_acr=0.5",
    "--model.aah.controller.budget.scope=model",
    "--model.aah.controller.need.probe_queries=16",
]


@pytest.mark.parametrize("configs", [DDP, FSDP2], ids=["ddp", "fsdp2"])
def test_both_ranks_start_from_the_source_and_decide_the_same_table(tmp_path, tiny_args, configs):
    # The source: the two-process runs' model (2 layers x 4 heads, d = 32, synthetic data, T = 32), trained 2 steps.
    main(tiny_args(f"--checkpoint.dirpath={tmp_path}/src", f"--trainer.logger.init_args.save_dir={tmp_path}/runs"))
    source = str(tmp_path / "src" / "last.ckpt")
    extra = ["--trainer.strategy.init_args.data_parallel_size=2"] if configs is FSDP2 else []
    fit(
        tmp_path,
        configs,
        f"--model.init_from={source}",
        *RETROFIT,
        *extra,
        "--trainer.callbacks+=helpers.weights.Weights",
        f"--trainer.callbacks.folder={tmp_path}/weights",
    )
    expected = retrofit.source_weights(source, retrofit.source_config(source))
    for rank in (0, 1):
        start = torch.load(tmp_path / "weights" / f"start_rank{rank}.pt", weights_only=True)
        assert start.keys() == {k for k in expected if k != "lm_head.weight"}  # tied: one parameter
        for name, value in start.items():
            assert torch.equal(value, expected[name]), (rank, name)
    r0, r1 = read_run(tmp_path / "rec", 0), read_run(tmp_path / "rec", 1)
    assert [r["table"] for r in r0] == [r["table"] for r in r1]  # one table on both ranks at every step
    assert r0[0]["table"] != [[32] * 4] * 2  # decided at step 0: full context costs more than the budget
    assert max(sum(min(w, 32) for row in r["table"] for w in row) / (8 * 32) for r in r0) <= 0.5
    if configs is FSDP2:
        sharded = next(r["sharded"] for r in r0 if "sharded" in r)
        assert all(local < whole for local, whole in sharded.values() if whole > 1)  # loaded, then really sharded
        # The run's own checkpoint, a folder of shards, is a source too: its settings and its final weights.
        folder = tmp_path / "ckpt" / "last.ckpt"
        assert retrofit.is_sharded_checkpoint(folder)
        theirs, ours = (asdict(retrofit.source_config(p)) for p in (folder, source))
        assert all(theirs[k] == ours[k] for k in retrofit.SOURCE_SETTINGS)
        end = torch.load(tmp_path / "weights" / "end_rank0.pt", weights_only=True)
        final = retrofit.source_weights(folder, retrofit.source_config(folder))
        assert not torch.equal(final["wte.weight"], expected["wte.weight"])  # trained on from the source
        for name, value in end.items():
            assert torch.equal(final[name], value), name
        again = tmp_path / "again"  # and a run on one process starts from it
        main(
            tiny_args(
                f"--model.init_from={folder}",
                f"--checkpoint.dirpath={again}/ckpt",
                "--trainer.callbacks+=helpers.weights.Weights",
                f"--trainer.callbacks.folder={again}",
                steps=1,
            )
        )
        start = torch.load(again / "start_rank0.pt", weights_only=True)
        assert all(torch.equal(start[name], value) for name, value in end.items())
