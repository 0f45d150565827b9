"""Two processes on CPU (gloo), through ``aah fit`` and the shipped configs: DDP and FSDP2 (ModelParallelStrategy) fit,
checkpoint, are preempted (an exception, or SIGTERM) and resume exactly; FSDP2 really shards; every rank keeps the same
window table.

The runs are shared: one uninterrupted DDP run is the reference for every DDP and FSDP2 resume (same data order, same
mathematics: their losses agree to float tolerance). The runs start their ranks as a launcher does, forked from a
server that imported aah once (``helpers.launch``: each process would otherwise spend ~8 s importing torch and
Lightning), except the DDP SIGTERM test's signalled run: one ``aah fit`` process whose second rank Lightning's own
launcher starts, as on a workstation, and which must train like the reference all the same."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from helpers.distributed import (
    DDP,
    FSDP2,
    STEPS,
    check_ranks,
    fit,
    fit_args,
    preempted_then_resumed,
    sigterm_then_resumed,
)
from helpers.launch import free_port
from helpers.resume import assert_same_training, read_run
from helpers.tb import read_events

pytestmark = pytest.mark.heavy  # every test here starts processes


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ddp_whole")
    fit(folder, DDP)
    return [read_run(folder / "rec", r) for r in (0, 1)]


def test_ddp_fit_checkpoint_preempt_resume_is_exact(tmp_path, ddp_reference):
    check_ranks(ddp_reference)
    preempted_then_resumed(tmp_path, DDP)
    for rank in (0, 1):
        assert_same_training(ddp_reference[rank], read_run(tmp_path / "rec", rank))
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == STEPS and len(ckpt["aah_rng"]) == 2
    assert ckpt["TextDataModule"]["layout"]["world_size"] == 2
    final_table = torch.tensor(ddp_reference[0][-1]["table"], dtype=torch.int32)
    assert torch.equal(ckpt["state_dict"]["model.windows"], final_table)


def test_fsdp2_shards_checkpoints_per_rank_and_resumes_like_ddp(tmp_path, ddp_reference):
    # Also: the attention-mass probe (a no-grad forward on every rank) must work on a sharded model; and the split
    # backend, whose layers reorder their sharded weights by head group (full-window heads on causal SDPA, the others
    # on banded), trains like the reference run's banded layers.
    extra = [
        "--model.gpt.backend=split",
        "--trainer.strategy.init_args.data_parallel_size=2",
        "--model.gpt.activation_checkpointing=true",
        "--diagnostics.amc_every_n_steps=2",
        "--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger",
        f"--trainer.logger.init_args.save_dir={tmp_path}/tb",
    ]
    preempted_then_resumed(tmp_path, FSDP2, *extra)
    amc = read_events(tmp_path / "tb")["scalars"]["aah/attention_mass_coverage"]
    assert {s for s, _ in amc} >= {2, 4, 6} and all(0 < v <= 1 for _, v in amc)  # before and after the resume
    runs = [read_run(tmp_path / "rec", r) for r in (0, 1)]
    check_ranks(runs)
    # train/loss is the step's mean over both ranks and both micro-batches (the recorder's rows are micro-batches in
    # order, two per step; Lightning hands callbacks each micro-batch's loss divided by accumulate_grad_batches).
    logged = dict(read_events(tmp_path / "tb")["scalars"]["train/loss"])  # a repeated step: the resumed run's value
    assert sorted(logged) == list(range(STEPS))
    for step, value in logged.items():
        losses = [2 * r["loss"] for run in runs for r in run[2 * step : 2 * step + 2]]
        assert value == pytest.approx(sum(losses) / 4, rel=1e-5), step
    # Sharded: every rank holds about half of each weight matrix.
    for run in runs:
        sharding = next(r["sharded"] for r in run if "sharded" in r)
        matrices = {k: v for k, v in sharding.items() if k.endswith("weight") and "ln" not in k}
        assert matrices and all(local <= (whole + 1) // 2 + 32 and local < whole for local, whole in matrices.values())
    # The same training as DDP: same batches and tables; losses equal up to the order of float reductions.
    for rank in (0, 1):
        assert_same_training(ddp_reference[rank], runs[rank], rel=1e-4)
    # A distributed checkpoint: one shard file per rank, plus metadata with both ranks' RNG states.
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_dir() and len([p for p in os.listdir(last) if p.endswith(".distcp")]) == 2
    meta = torch.load(last / "meta.pt", weights_only=True)
    assert meta["global_step"] == STEPS and len(meta["aah_rng"]) == 2


def test_ddp_sigterm_to_one_rank_stops_both_after_the_step_and_resumes_exactly(tmp_path, ddp_reference):
    # Rank 1 alone is signalled (Lightning's launcher started it; rank 0 never hears of the signal): the ranks agree
    # at the step boundary, rank 0 writes the checkpoint of that step.
    sigterm_then_resumed(tmp_path, DDP, 1, lightning_launch=True)
    for rank in (0, 1):
        assert_same_training(ddp_reference[rank], read_run(tmp_path / "rec", rank))
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["global_step"] == STEPS


def test_fsdp2_sigterm_saves_every_shard_of_the_step_and_resumes_like_ddp(tmp_path, ddp_reference):
    sigterm_then_resumed(tmp_path, FSDP2, 0, "--trainer.strategy.init_args.data_parallel_size=2")
    for rank in (0, 1):
        assert_same_training(ddp_reference[rank], read_run(tmp_path / "rec", rank), rel=1e-4)
    assert torch.load(tmp_path / "ckpt" / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == STEPS


def test_fsdp2_on_a_full_disk_stops_every_rank_in_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    """A real 1000 KiB file system: room for the first distributed checkpoint (about 590 KiB: two shards, the metadata
    and meta.pt), not for the next one beside it. Every rank stops with exit code 4, rank 0 says why in one line, and
    last.ckpt still names the complete checkpoint of step 1."""
    from helpers.disks import small_disk
    from helpers.launch import run_ranks

    with small_disk(tmp_path / "disk", "1000k") as disk:
        folder = disk / "ckpt"
        args = fit_args(
            tmp_path, FSDP2, f"--checkpoint.dirpath={folder}", "--trainer.strategy.init_args.data_parallel_size=2"
        )
        codes, output = run_ranks(args, 2, tmp_path, tmp_path / "fit", timeout=600)
        assert codes == [4, 4], output[-4000:]
        assert "Traceback" not in output, output[-4000:]
        lines = [line for line in output.splitlines() if line.startswith("aah: ")]
        assert len(lines) == 1, output[-4000:]
        assert lines[0].startswith(
            f"aah: error: could not write checkpoint {folder}/last.ckpt: no space left in {folder} (the checkpoint "
            "needs about "
        ), lines
        assert "the previous checkpoint there (if any) is intact" in lines[0]
        names = sorted(os.listdir(folder))  # the link and the folder it names: no temporary folder, no lock
        assert len(names) == 2 and names[1] == "last.ckpt" and names[0].startswith(".last.ckpt."), names
        assert os.path.realpath(folder / "last.ckpt") == str(folder / names[0])
        assert torch.load(folder / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 1
        assert len([p for p in os.listdir(folder / "last.ckpt") if p.endswith(".distcp")]) == 2


def test_tensor_parallel_defaults_are_refused(tmp_path):
    # ModelParallelStrategy's "auto" sizes put both processes in one tensor-parallel group: nothing would be sharded
    # and gradients never averaged. aah stops with the fix instead.
    proc = fit(
        tmp_path,
        FSDP2,
        "--trainer.strategy.init_args.data_parallel_size=1",
        "--trainer.strategy.init_args.tensor_parallel_size=2",
        expect_ok=False,
    )
    assert proc.returncode != 0 and "data_parallel_size" in proc.stderr and "tensor_parallel_size=1" in proc.stderr


def test_compiled_checkpointed_blocks_train_like_eager_and_window_changes_do_not_recompile(tmp_path, tiny_args):
    # One process: the compiled path is the same under every strategy. fullgraph=True makes any graph break inside a
    # block (attention included) an error. Windows < T in every layer keep each layer on the masked path. Compiled
    # with activation checkpointing (recomputation inside the graph); tools/gpu_check.py's CPU dry run, also a test,
    # trains compiled blocks without it.
    from aah_lightning.cli import main

    policy = [
        "--model.aah.policy=random",
        "--model.aah.candidates=[8,16]",
        "--model.aah.random.redraw_interval=2",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
    ]
    for mode in ("eager", "compiled"):
        main(
            tiny_args(
                *policy,
                f"--model.gpt.compile_blocks={mode == 'compiled'}",
                f"--model.gpt.activation_checkpointing={mode == 'compiled'}",
                f"--checkpoint.dirpath={tmp_path}/{mode}",
                "--trainer.callbacks+=helpers.resume.Recorder",
                f"--trainer.callbacks.folder={tmp_path}/{mode}",
                steps=4,
            )
        )
    eager, compiled = read_run(tmp_path / "eager"), read_run(tmp_path / "compiled")
    assert [r["table"] for r in compiled] == [r["table"] for r in eager] and len({str(r["table"]) for r in eager}) > 1
    assert [r["loss"] for r in compiled] == pytest.approx([r["loss"] for r in eager], rel=1e-5)
    assert compiled[0]["graphs"] > eager[-1]["graphs"]  # it did compile
    assert compiled[-1]["graphs"] == compiled[0]["graphs"]  # and nothing after the first step, tables changing


# -- the window-table check, without Lightning ------------------------------------------------------------------------
def _table_check_worker(rank, world, port, out):
    import torch.distributed as dist

    from aah_lightning.lit.distributed import WindowTableSync

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for diverge in (False, True):
            sync, table = WindowTableSync(check_every=0), torch.full((2, 4), 32, dtype=torch.int32)
            try:
                for step in range(4):
                    changed = step == 2
                    if changed:  # a policy change; the diverging rank swaps two heads (same sum, other table)
                        table = torch.tensor([[8, 16, 32, 32], [32, 32, 32, 32]], dtype=torch.int32)
                        if diverge and rank == 1:
                            table = torch.tensor([[16, 8, 32, 32], [32, 32, 32, 32]], dtype=torch.int32)
                    sync.update(table, step, changed)
                out[(diverge, rank)] = "ok"
            except RuntimeError as e:
                out[(diverge, rank)] = str(e)
    finally:
        dist.destroy_process_group()


def test_window_table_check_catches_a_rank_that_differs():
    port = free_port()
    out = mp.Manager().dict()
    # forked, not spawned: the ranks start with torch and the package already imported
    mp.start_processes(_table_check_worker, args=(2, port, out), nprocs=2, join=True, start_method="fork")
    assert out[(False, 0)] == out[(False, 1)] == "ok"  # the same tables pass
    # A rank with another table: both ranks stop, at the step of the change, with the reason.
    assert all("differs between ranks" in out[(True, r)] and "step 2" in out[(True, r)] for r in (0, 1)), dict(out)


# -- resuming on another number of processes ---------------------------------------------------------------------------
def _step_rows(parts: list[tuple[int, list[list[dict]]]]) -> list[list[dict]]:
    """The recorded micro-batches of each optimizer step, every rank's together. ``parts``: (steps, rows of each
    rank) of the consecutive runs; a run of W ranks and accumulation A wrote A rows per step on each rank."""
    steps = []
    for n_steps, ranks in parts:
        per_step = len(ranks[0]) // n_steps
        steps += [[r for rows in ranks for r in rows[s * per_step : (s + 1) * per_step]] for s in range(n_steps)]
    return steps


@pytest.mark.parametrize("configs", [DDP, FSDP2], ids=["ddp", "fsdp2"])
def test_resume_on_one_process_then_two_again_trains_like_the_uninterrupted_run(tmp_path, ddp_reference, configs):
    # 2 processes to step 1, 1 process to step 3, 2 processes to the end; the global batch (16 blocks) is kept by
    # data.global_batch_size: accumulation 2, then 4, then 2. Interrupted at steps that are no validation steps.
    def args(world):
        extra = ["--data.global_batch_size=16", "--trainer.accumulate_grad_batches=1", f"--trainer.devices={world}"]
        if configs is FSDP2:
            extra.append(f"--trainer.strategy.init_args.data_parallel_size={world}")
        return extra

    def interrupted(world, at_step, *resume):
        callback = ["--trainer.callbacks+=helpers.resume.Interrupt", f"--trainer.callbacks.at_step={at_step}"]
        proc = fit(tmp_path, configs, *args(world), *callback, *resume, expect_ok=False)
        assert proc.returncode != 0 and "simulated preemption" in proc.stderr, proc.stderr[-4000:]
        return proc

    runs = [interrupted(2, 1), interrupted(1, 3, "--ckpt_path=last")]
    runs.append(fit(tmp_path, configs, *args(2), "--ckpt_path=last"))
    assert not any("data layout" in p.stderr or "RNG states" in p.stderr for p in runs)  # an exact resume: no warning
    rank0, rank1 = (read_run(tmp_path / "rec", r) for r in (0, 1))
    assert len(rank0) == 2 + 8 + 6 and len(rank1) == 2 + 6
    parts = _step_rows(
        [(1, [rank0[:2], rank1[:2]]), (2, [rank0[2:10]]), (3, [rank0[10:], rank1[2:]])]  # 4 micro-batches of 4
    )
    whole = _step_rows([(STEPS, ddp_reference)])
    assert len(parts) == len(whole) == STEPS
    for step, (a, b) in enumerate(zip(whole, parts)):
        # The same blocks in every optimizer step (in other micro-batches and ranks), the same window table.
        assert sorted(i for r in a for i in r["index"]) == sorted(i for r in b for i in r["index"]), step
        assert {str(r["table"]) for r in a} == {str(r["table"]) for r in b} and len({str(r["table"]) for r in b}) == 1
        # The step's loss: the mean over its blocks (each row holds its micro-batch's mean / accumulation).
        world_a, world_b = 2, 1 if 1 <= step < 3 else 2
        loss_a, loss_b = sum(r["loss"] for r in a) / world_a, sum(r["loss"] for r in b) / world_b
        assert loss_b == pytest.approx(loss_a, rel=1e-4), step
    assert len({str(s[0]["table"]) for s in whole}) > 1  # the table changed during the run, in every part
    last = tmp_path / "ckpt" / "last.ckpt"
    if configs is DDP:
        ckpt = torch.load(last, weights_only=True)
        assert torch.equal(ckpt["state_dict"]["model.windows"], torch.tensor(whole[-1][0]["table"], dtype=torch.int32))
        layout = ckpt["TextDataModule"]["layout"]
    else:  # resharded twice: the folder holds one shard per rank of the last run
        assert len([p for p in os.listdir(last) if p.endswith(".distcp")]) == 2
        layout = torch.load(last / "meta.pt", weights_only=True)["TextDataModule"]["layout"]
    assert (layout["world_size"], layout["accumulate_grad_batches"]) == (2, 2)
