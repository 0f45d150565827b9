"""Exact resume on one process: a run interrupted at step k and resumed with ``--ckpt_path last`` trains on the same
batches, draws the same random numbers, ends with the same losses, weights and window table as a run that was never
interrupted. Map-style and streamed data, with gradient accumulation and a window table that changes mid-run.

A run continued from its checkpoint logs like one that was never stopped: into its own log folder, and at the
same steps. Extending a finished run (a larger max_steps) is the case where Lightning's bookkeeping slipped."""

from __future__ import annotations

import os
import warnings

import datasets
import pytest
import torch

from aah_lightning.cli import main
from aah_lightning.data import corpora
from aah_lightning.data.packing import EndlessSampler
from aah_lightning.data.synthetic import synthetic_documents
from aah_lightning.lit.datamodule import TextDataModule
from helpers.resume import INTERRUPT_AT, STEPS, check_resumed, interrupted_then_resumed, read_run, run_args
from helpers.tb import read_events


def test_map_style_resume_is_exact(tmp_path, tiny_args):
    main(run_args(tiny_args, tmp_path / "whole"))
    interrupted_then_resumed(tiny_args, tmp_path / "parts")
    check_resumed(tmp_path)
    # The checkpoint records the data layout the position depends on.
    layout = torch.load(tmp_path / "parts/ckpt/last.ckpt", weights_only=True)["TextDataModule"]["layout"]
    assert layout["batch_size"] == 4 and layout["accumulate_grad_batches"] == 2 and layout["world_size"] == 1


def _amc(folder) -> dict[int, float]:
    """The logged attention-mass coverage by step; where a resumed run repeats steps, its later values win."""
    return dict(read_events(folder / "runs")["scalars"]["aah/attention_mass_coverage"])


def test_resumed_run_logs_the_same_attention_mass_coverage(tmp_path, tiny_args):
    # The probe samples its query positions from the callback's own generator, saved in the checkpoint.
    amc = ["--diagnostics.amc_every_n_steps=1", "--diagnostics.amc_queries=4"]  # 4 of 32 positions: a real sample
    main(run_args(tiny_args, tmp_path / "whole", *amc))
    interrupted_then_resumed(tiny_args, tmp_path / "parts", *amc)
    whole, parts = _amc(tmp_path / "whole"), _amc(tmp_path / "parts")
    assert sorted(whole) == sorted(parts) and len(whole) >= STEPS
    assert len(set(whole.values())) > 1  # a sample that changes from step to step, so a restart would show
    assert [parts[s] for s in sorted(parts)] == pytest.approx([whole[s] for s in sorted(whole)], rel=1e-6)


def _fake_hub(monkeypatch, n_shards=3):
    """A local streamed dataset in place of the hub: documents of many lengths, some longer than a block."""
    rng = torch.Generator().manual_seed(0)
    texts = []
    for i, doc in enumerate(synthetic_documents(30, 48, 20, 26, seed=1)):
        length = int(torch.randint(3, 90, (1,), generator=rng))
        texts.append("".join(chr(97 + int(t) % 26) for t in doc)[:length] + f" #{i}")
    table = datasets.Dataset.from_dict({"text": texts})
    monkeypatch.setattr(corpora, "hub_corpus", lambda *a, **k: table.to_iterable_dataset(num_shards=n_shards))
    return texts


def test_streamed_resume_is_exact(tmp_path, tiny_args, monkeypatch):
    _fake_hub(monkeypatch)
    extra = ["--data.source=hub", "--data.hub.name=local/fake", "--data.val_blocks=3", "--data.test_blocks=2"]
    main(run_args(tiny_args, tmp_path / "whole", *extra))
    saved = interrupted_then_resumed(tiny_args, tmp_path / "parts", *extra)
    check_resumed(tmp_path)
    at_interrupt = saved["TextDataModule"]["streams"][0]["0"]
    assert at_interrupt["block"] == INTERRUPT_AT * 2 * 4 and at_interrupt["offset"] > 0  # resumed inside a document
    final = torch.load(tmp_path / "parts/ckpt/last.ckpt", weights_only=True)["TextDataModule"]["streams"][0]["0"]
    assert final["block"] == STEPS * 2 * 4 and final["pass"] >= 1  # and the stream started a second pass


def test_a_resume_keeps_the_global_batch_and_refuses_another_in_one_line(tmp_path, tiny_args, capsys):
    main(run_args(tiny_args, tmp_path / "a", "--trainer.max_steps=2"))  # 4 blocks x 2 micro-batches
    with pytest.raises(SystemExit) as e:
        main(run_args(tiny_args, tmp_path / "a", "--trainer.max_steps=3", "--data.batch_size=2", "--ckpt_path=last"))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("aah: error: the checkpoint was trained with a global batch of 8 blocks")
    assert "set data.global_batch_size=8 (or trainer.accumulate_grad_batches=4)" in err[0]
    # A fix it names continues the run (the same global batch in smaller micro-batches), without a warning.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(
            run_args(
                tiny_args,
                tmp_path / "a",
                "--trainer.max_steps=3",
                "--data.batch_size=2",
                "--trainer.accumulate_grad_batches=4",
                "--ckpt_path=last",
            )
        )
    assert not [w for w in caught if "data layout" in str(w.message)]
    # Step 2 holds global positions 16-23 in four micro-batches of 2, optimizer steps falling every fourth.
    rows = read_run(tmp_path / "a" / "rec")
    assert [len(r["index"]) for r in rows] == [4] * 4 + [2] * 4 and [r["step"] for r in rows[4:]] == [2, 2, 2, 3]
    data = TextDataModule(source="synthetic", seq_len=32, batch_size=4, synthetic={"documents": 64})
    data.setup("fit")
    order = EndlessSampler(len(data.train_set), seed=1234, length=24).permutation(0).tolist()
    assert [i for r in rows for i in r["index"]] == order[:24]
    saved = torch.load(tmp_path / "a/ckpt/last.ckpt", weights_only=True)
    assert saved["global_step"] == 3 and saved["TextDataModule"]["layout"]["accumulate_grad_batches"] == 4


def test_resume_with_another_seed_warns(tmp_path, tiny_args):
    main(run_args(tiny_args, tmp_path / "a", "--trainer.max_steps=2"))
    with pytest.warns(UserWarning, match="seed: 1234 -> 7"):
        main(run_args(tiny_args, tmp_path / "a", "--trainer.max_steps=3", "--data.seed=7", "--ckpt_path=last"))


# The checkpoint interval does not divide the first run's length: its last checkpoint is the final step's.
ARGS = ["--checkpoint.every_n_train_steps=4", "--trainer.enable_model_summary=false"]


def _curves(folder) -> dict[str, list[tuple[int, float]]]:
    scalars = read_events(folder / "runs")["scalars"]
    return {tag: scalars[tag] for tag in ("train/loss", "val/loss", "epoch")}


def test_an_extended_run_logs_the_uninterrupted_runs_steps_into_its_own_folder(tmp_path, tiny_args):
    main(tiny_args(*ARGS, steps=10))
    os.rename(tmp_path / "runs", tmp_path / "whole")
    main(tiny_args(*ARGS, steps=6))
    main(tiny_args(*ARGS, "--ckpt_path=last", steps=10))
    whole = {tag: values for tag, values in read_events(tmp_path / "whole")["scalars"].items()}
    extended = _curves(tmp_path)
    for tag in ("train/loss", "val/loss"):
        assert [s for s, _ in extended[tag]] == [s for s, _ in whole[tag]], tag
        assert [v for _, v in extended[tag]] == pytest.approx([v for _, v in whole[tag]], rel=1e-5), tag
    assert [s for s, _ in extended["epoch"]] == [s for s, _ in whole["epoch"]]
    # The finished run had completed its pass over its data, so the extension counts one more epoch, not two.
    assert max(v for _, v in extended["epoch"]) == 1
    # One run, one folder: the resume wrote its events and config.yaml next to the first part's.
    assert os.listdir(tmp_path / "runs" / "tiny") == ["version_0"]
    assert os.path.exists(tmp_path / "runs" / "tiny" / "version_0" / "config.yaml")


def test_a_resume_keeps_a_log_version_the_config_gives(tmp_path, tiny_args):
    main(tiny_args(*ARGS, steps=2))
    main(tiny_args(*ARGS, "--ckpt_path=last", "--trainer.logger.init_args.version=second_part", steps=3))
    assert sorted(os.listdir(tmp_path / "runs" / "tiny")) == ["second_part", "version_0"]


def test_a_rank_without_a_saved_rng_state_derives_one_from_seed_rank_and_step(monkeypatch):
    from aah_lightning.lit.distributed import derived_rng_state, rng_state

    monkeypatch.setenv("PL_GLOBAL_SEED", "1234")
    before = rng_state()
    a, b = derived_rng_state(1, 3), derived_rng_state(1, 3)
    assert torch.equal(a["torch"], b["torch"]) and a["python"] == b["python"]  # the same on every resume
    assert not torch.equal(a["torch"], derived_rng_state(2, 3)["torch"])  # another rank: another stream
    assert not torch.equal(a["torch"], derived_rng_state(1, 4)["torch"])  # another step: another stream
    monkeypatch.setenv("PL_GLOBAL_SEED", "1235")
    assert not torch.equal(a["torch"], derived_rng_state(1, 3)["torch"])  # another seed
    assert torch.equal(rng_state()["torch"], before["torch"])  # the caller's generators are left as they were


def test_a_checkpoint_of_another_world_size_validates_and_its_resume_fix_works(tmp_path, capsys):
    """A checkpoint of a run on 2 processes (global batch 2 x 4 = 8), used on 1: validate and test read no data
    position, so they run with or without data.global_batch_size; a resume without it is refused, and the fix the
    line suggests resumes."""
    from aah_lightning.checkpoint import DATAMODULE_STATE_KEY
    from helpers.cli import cli_error, tiny_config, train_tiny

    folder = train_tiny(tmp_path / "first", "--trainer.max_steps=2")
    ckpt = torch.load(os.path.join(folder, "last.ckpt"), weights_only=True)
    layout = ckpt[DATAMODULE_STATE_KEY]["layout"]
    assert (layout["batch_size"], layout["world_size"], layout["accumulate_grad_batches"]) == (4, 1, 1)
    layout["world_size"] = 2  # what the same run on two processes saves
    two = tmp_path / "two_processes.ckpt"
    torch.save(ckpt, two)

    config = tiny_config(tmp_path)
    for subcommand in ("validate", "test"):
        for extra in ([], ["--data.global_batch_size=8"]):
            main([subcommand, "--config", config, "--ckpt_path", str(two), *extra])

    fit = ["fit", "--config", config, "--ckpt_path", str(two), "--trainer.max_steps=4"]
    code, line = cli_error(fit, capsys)
    assert code == 2 and "the checkpoint was trained with a global batch of 8 blocks" in line, line
    assert line.endswith("set data.global_batch_size=8 (or trainer.accumulate_grad_batches=2) to resume it")
    main([*fit, "--data.global_batch_size=8"])
    assert torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=True)["global_step"] == 4


@pytest.mark.parametrize("given", ["file", "last"])
def test_a_resume_reads_its_checkpoint_once_before_lightning_loads_it(tmp_path, tiny_args, monkeypatch, given):
    # The checks before the run (the model's shape, the data layout, the log folder) share one read; Lightning's own
    # load through AtomicCheckpointIO is the other. "last" reads the candidates once more to find the highest step.
    main(tiny_args(steps=2))
    last = os.fspath(tmp_path / "ckpt" / "last.ckpt")
    reads = []
    load = torch.load

    def counting(f, *args, **kwargs):
        if isinstance(f, (str, os.PathLike)) and os.fspath(f) == last:
            reads.append(kwargs.get("mmap", False))
        return load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting)
    main(tiny_args(f"--ckpt_path={last if given == 'file' else 'last'}", steps=3))
    # the pickle-only reads (memory-mapped) before the run, then Lightning's one full read
    assert reads == ([True, False] if given == "file" else [True, True, False])
    assert load(last, weights_only=True)["global_step"] == 3


def test_a_resume_checks_the_model_and_the_data_layout_once(tmp_path, tiny_args, monkeypatch):
    # The CLI checks before the Trainer starts; the hooks Lightning calls while it restores (on_load_checkpoint,
    # the data module's load_state_dict) check only what was not checked before (a Trainer driven directly).
    from aah_lightning import preflight
    from aah_lightning.lit import module as module_mod
    from aah_lightning.lit.data_position import DataPosition

    main(tiny_args(steps=2))
    calls = {"model": 0, "data": 0}

    def counted(kind, real):
        def wrapper(*args, **kwargs):
            calls[kind] += 1
            return real(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(preflight, "check_matches", counted("model", preflight.check_matches))
    monkeypatch.setattr(module_mod, "check_matches", counted("model", module_mod.check_matches))
    monkeypatch.setattr(DataPosition, "check_resume", counted("data", DataPosition.check_resume))
    main(tiny_args("--ckpt_path=last", steps=3))
    assert calls == {"model": 1, "data": 1}
