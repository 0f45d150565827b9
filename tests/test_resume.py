"""Exact resume on one process: a run interrupted at step k and resumed with ``--ckpt_path last`` trains on the same
batches, draws the same random numbers, ends with the same losses, weights and window table as a run that was never
interrupted. Map-style and streamed data, with gradient accumulation and a window table that changes mid-run."""

from __future__ import annotations

import datasets
import pytest
import torch

from _resume_helpers import read_run
from aah_lightning.cli import main
from aah_lightning.data import corpora
from aah_lightning.data.synthetic import synthetic_documents
from tb import read_events

STEPS, INTERRUPT_AT = 8, 4
POLICY = ["--model.aah.policy=random", "--model.aah.candidates=[8,16,32]", "--model.aah.redraw_interval=3"]


def _run(tiny_args, folder, *extra):
    return tiny_args(
        *POLICY,
        "--trainer.accumulate_grad_batches=2",
        "--checkpoint.every_n_train_steps=1",
        f"--checkpoint.dirpath={folder}/ckpt",
        "--trainer.callbacks+=_resume_helpers.Recorder",
        f"--trainer.callbacks.folder={folder}/rec",
        f"--trainer.logger.init_args.save_dir={folder}/runs",
        *extra,
        steps=STEPS,
    )


def _interrupted_then_resumed(tiny_args, folder, *extra):
    with pytest.raises(RuntimeError, match="simulated preemption"):
        main(
            _run(
                tiny_args,
                folder,
                *extra,
                "--trainer.callbacks+=_resume_helpers.Interrupt",
                f"--trainer.callbacks.at_step={INTERRUPT_AT}",
            )
        )
    saved = torch.load(f"{folder}/ckpt/last.ckpt", weights_only=True)
    assert saved["global_step"] == INTERRUPT_AT
    main(_run(tiny_args, folder, *extra, "--ckpt_path=last"))
    return saved


def assert_same_training(whole: list[dict], parts: list[dict], rel=1e-6):
    assert [r["step"] for r in parts] == [r["step"] for r in whole]
    assert [r["index"] for r in parts] == [r["index"] for r in whole]
    assert [r["tokens"] for r in parts] == [r["tokens"] for r in whole]  # the same batches
    assert [r["table"] for r in parts] == [r["table"] for r in whole]
    assert [r["rand"] for r in parts] == [r["rand"] for r in whole]  # the RNG continued, not restarted
    assert [r["loss"] for r in parts] == pytest.approx([r["loss"] for r in whole], rel=rel, abs=1e-7)


def assert_same_checkpoint(a: str, b: str, rel=1e-6):
    sa, sb = (torch.load(p, weights_only=True)["state_dict"] for p in (a, b))
    assert sa.keys() == sb.keys()
    assert torch.equal(sa["model.windows"], sb["model.windows"])
    for key in sa:
        torch.testing.assert_close(sb[key], sa[key], rtol=rel, atol=1e-7, msg=key)


def _check(tmp_path):
    whole, parts = read_run(tmp_path / "whole" / "rec"), read_run(tmp_path / "parts" / "rec")
    assert len(whole) == STEPS * 2  # micro-batches
    assert len({str(r["table"]) for r in whole}) > 1  # the table changed during the run, also after the resume
    assert_same_training(whole, parts)
    assert_same_checkpoint(tmp_path / "whole/ckpt/last.ckpt", tmp_path / "parts/ckpt/last.ckpt")


def test_map_style_resume_is_exact(tmp_path, tiny_args):
    main(_run(tiny_args, tmp_path / "whole"))
    _interrupted_then_resumed(tiny_args, tmp_path / "parts")
    _check(tmp_path)
    # The checkpoint records the data layout the position depends on.
    layout = torch.load(tmp_path / "parts/ckpt/last.ckpt", weights_only=True)["TextDataModule"]["layout"]
    assert layout["batch_size"] == 4 and layout["accumulate_grad_batches"] == 2 and layout["world_size"] == 1


def _amc(folder) -> dict[int, float]:
    """The logged attention-mass coverage by step; where a resumed run repeats steps, its later values win."""
    return dict(read_events(folder / "runs")["scalars"]["aah/attention_mass_coverage"])


def test_resumed_run_logs_the_same_attention_mass_coverage(tmp_path, tiny_args):
    # The probe samples its query positions from the callback's own generator, saved in the checkpoint.
    amc = ["--diagnostics.amc_every_n_steps=1", "--diagnostics.amc_queries=4"]  # 4 of 32 positions: a real sample
    main(_run(tiny_args, tmp_path / "whole", *amc))
    _interrupted_then_resumed(tiny_args, tmp_path / "parts", *amc)
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
    extra = ["--data.source=hub", "--data.hub_name=local/fake", "--data.val_blocks=3", "--data.test_blocks=2"]
    main(_run(tiny_args, tmp_path / "whole", *extra))
    saved = _interrupted_then_resumed(tiny_args, tmp_path / "parts", *extra)
    _check(tmp_path)
    at_interrupt = saved["TextDataModule"]["streams"][0]["0"]
    assert at_interrupt["block"] == INTERRUPT_AT * 2 * 4 and at_interrupt["offset"] > 0  # resumed inside a document
    final = torch.load(tmp_path / "parts/ckpt/last.ckpt", weights_only=True)["TextDataModule"]["streams"][0]["0"]
    assert final["block"] == STEPS * 2 * 4 and final["pass"] >= 1  # and the stream started a second pass


def test_resume_with_another_batch_size_warns(tmp_path, tiny_args):
    main(_run(tiny_args, tmp_path / "a", "--trainer.max_steps=2"))
    with pytest.warns(UserWarning, match="batch_size: 4 -> 2"):
        main(_run(tiny_args, tmp_path / "a", "--trainer.max_steps=3", "--data.batch_size=2", "--ckpt_path=last"))
