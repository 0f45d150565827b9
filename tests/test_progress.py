"""Progress of the long stages (aah_lightning/progress.py): silent while short, then a line on stderr or a task of a
run's own bar; on the controller's decision, ``aah-prepare``, ``aah import`` and ``aah export``."""

from __future__ import annotations

import io
import time

import pytest
import torch

from aah_lightning import progress
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from aah_lightning.windows.config import AAHConfig
from aah_lightning.windows.policy_base import make_policy
from helpers.controller_inputs import controller_settings


@pytest.fixture
def at_once(monkeypatch):
    """Every stage shown from its start (the default waits AFTER_S seconds: the tiny stages here take less)."""
    monkeypatch.setattr(progress, "AFTER_S", 0.0)


def test_a_short_stage_shows_nothing_and_a_long_one_its_count_and_time(capsys):
    with progress.stage("short", total=3) as s:
        s.advance(3)
    assert capsys.readouterr().err == ""
    with progress.stage("counted", total=4, unit="fwd", after=0.2):
        for _ in range(4):
            time.sleep(0.15)
            progress.current().advance()
    with progress.stage("one long call", after=0.2):
        time.sleep(1.3)
    err = capsys.readouterr().err
    assert "counted: 100%" in err and "4/4" in err, err
    assert "one long call: 00:01" in err, err  # the time since the stage began, refreshed within the call
    progress.current().advance()  # outside any stage: nothing to count, nothing shown
    assert capsys.readouterr().err == ""


def test_a_stage_is_a_task_of_the_bar_a_run_lends(at_once):
    from rich.console import Console
    from rich.progress import Progress

    out = io.StringIO()
    bar = Progress(console=Console(file=out, force_terminal=True, width=120))
    with bar:
        progress.lend_bar(bar)
        try:
            with progress.stage("inside the run", total=2) as s:
                assert [t.description for t in bar.tasks] == ["inside the run"]
                s.advance(2)
                assert bar.tasks[0].completed == 2
        finally:
            progress.return_bar(bar)
        assert bar.tasks == []  # the run's bar keeps only its own tasks
    assert "inside the run" in out.getvalue()


@pytest.mark.parametrize("signal", ["gain", "retrieval"])
def test_the_controllers_decision_shows_its_forwards(at_once, capsys, signal):
    T = 32
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, seq_len=T, n_layer=2, n_head=2, n_embd=16))
    settings = controller_settings(
        target_acr=0.5, budget_scope="model", warmup_steps=0, control_interval=1, grouping="none", signal=signal
    )
    settings.need.copy_span = 4
    cfg = AAHConfig(policy="adaptive", candidates=[8, 16, 32], controller=settings)
    policy = make_policy(cfg, 2, 2, T)
    policy.set_run_length(4)
    model.set_windows(policy.initial_table())
    batch = {"tokens": torch.randint(0, 32, (2, T + 1), generator=torch.Generator().manual_seed(1))}
    policy.on_train_step(0, model, batch)
    err = capsys.readouterr().err
    # gain: the base forward and one per head and candidate other than its window in force (full: 2 of 3);
    # retrieval: one forward, then each layer's scores
    count = "9/9" if signal == "gain" else "3/3"
    assert f"windows at step 0: measuring ({signal} signal): 100%" in err and count in err, err


def test_aah_import_and_aah_export_show_reading_and_writing(at_once, tmp_path, capsys):
    from aah_lightning.cli import main
    from helpers.hf_models import save_tiny, save_tokenizer

    save_tiny("llama3", tmp_path / "hf")
    save_tokenizer(tmp_path / "hf")
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "llama.ckpt")])
    err = capsys.readouterr().err
    assert done.value.code == 0, err
    assert f"reading {tmp_path / 'hf'}: 00:00" in err and f"writing {tmp_path / 'llama.ckpt'}: 00:00" in err, err
    with pytest.raises(SystemExit) as done:
        main(["export", "--ckpt_path", str(tmp_path / "llama.ckpt"), "--out", str(tmp_path / "export")])
    err = capsys.readouterr().err
    assert done.value.code == 0, err
    assert f"reading {tmp_path / 'llama.ckpt'}: 00:00" in err and f"writing {tmp_path / 'export'}: 00:00" in err, err


def test_aah_prepare_shows_reading_writing_and_checking(at_once, tmp_path, capsys):
    from aah_lightning.data import prepare

    (tmp_path / "a.txt").write_text("def f():\n    return 1\n" * 50)
    prepare.main(["--source", "files", "--paths", str(tmp_path / "a.txt"), "--out", str(tmp_path / "tokens")])
    err = capsys.readouterr().err
    assert "reading the corpus (files): 00:00" in err and "writing token folder: 100%" in err and "1/1" in err, err
    prepare.main(["--verify", str(tmp_path / "tokens")])
    out, err = capsys.readouterr()
    assert "intact" in out and f"checking {tmp_path / 'tokens'}: 100%" in err, err


def test_in_a_run_the_decision_is_a_task_of_its_progress_bar(at_once, tmp_path):
    """Lightning's rich bar holds the terminal while training runs: the decision shows inside it, as a task."""
    import lightning as L

    from aah_lightning.lit.datamodule import TextDataModule
    from aah_lightning.lit.module import AAHModule
    from aah_lightning.lit.throughput import ProgressBar

    screen = io.StringIO()
    settings = controller_settings(
        target_acr=0.5, budget_scope="model", warmup_steps=0, control_interval=10, grouping="none", signal="gain"
    )
    model = AAHModule(
        gpt=GPTConfig(n_layer=2, n_head=2, n_embd=16, seq_len=32, vocab_size=65),
        aah=AAHConfig(policy="adaptive", candidates=[8, 16, 32], controller=settings),
    )
    data = TextDataModule(source="synthetic", seq_len=32, batch_size=2, synthetic={"documents": 40})
    bar = ProgressBar(console_kwargs={"file": screen, "force_terminal": True, "width": 160})
    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[bar], default_root_dir=tmp_path,
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    assert "windows at step 0: measuring (gain signal)" in screen.getvalue()
    assert progress._bars == []  # the run's bar is given back when it ends
