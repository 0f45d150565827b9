"""SIGTERM to ``aah fit`` (a preemption, ``kill``, ``scontrol requeue``): the step in progress is finished, that step's
``last.ckpt`` is written, one line says how to resume, the exit code is 143, a second SIGTERM during the save changes
nothing, and ``--ckpt_path last`` continues exactly as a run that was never stopped. Two processes (DDP, FSDP2):
tests/distributed/test_ddp_fsdp2.py; through SLURM: tests/distributed/test_slurm_real.py."""

from __future__ import annotations

import signal

import pytest

from aah_lightning.checkpoint import load_checkpoint_file
from aah_lightning.cli import main, sigterm_report
from aah_lightning.lit.signals import SignalStop
from helpers.resume import INTERRUPT_AT, check_resumed, run_args
from helpers.signals import hold_args, run_and_sigterm, sigterm_lines
from helpers.tb import read_events

pytestmark = pytest.mark.heavy


def test_sigterm_finishes_the_step_saves_it_and_resumes_exactly(tmp_path, tiny_args):
    main(run_args(tiny_args, tmp_path / "whole"))  # the reference: never stopped

    parts = tmp_path / "parts"
    # Held inside the accumulation window of step INTERRUPT_AT + 1 until the signal is in; a second SIGTERM arrives
    # while the stop's checkpoint is being saved.
    args = run_args(tiny_args, parts, *hold_args(parts, INTERRUPT_AT, second_at_save=True))
    code, stderr = run_and_sigterm(args, parts, second_at_save=True)
    lines = sigterm_lines(stderr)
    assert code == 143 and len(lines) == 1, stderr[-4000:]
    step = INTERRUPT_AT + 1  # the step the signal came in was finished, not abandoned
    last = parts / "ckpt" / "last.ckpt"
    assert lines[0].startswith(
        f"aah: stopped by SIGTERM after step {step}: its checkpoint is {last}; resume with: aah fit "
    )
    assert lines[0].endswith(" --ckpt_path last") and "--trainer.max_steps=8" in lines[0]
    assert "Traceback" not in stderr
    assert load_checkpoint_file(last)["global_step"] == step  # complete (checksums), and of that step
    # Every step up to the stop step reached TensorBoard before the exit, as in the run that was never stopped.
    whole_loss = read_events(tmp_path / "whole" / "runs")["scalars"]["train/loss"]
    assert read_events(parts / "runs")["scalars"]["train/loss"] == whole_loss[:step]

    main(run_args(tiny_args, parts, "--ckpt_path=last"))
    check_resumed(tmp_path)  # the same batches, tables, random draws and losses; the same final weights


def test_sigint_once_is_sigterm_with_exit_code_130(tmp_path, tiny_args):
    """Ctrl-C: the step is finished and saved, one line, exit code 130, and the resume is exact."""
    main(run_args(tiny_args, tmp_path / "whole"))

    parts = tmp_path / "parts"
    args = run_args(tiny_args, parts, *hold_args(parts, INTERRUPT_AT))
    code, stderr = run_and_sigterm(args, parts, signum=signal.SIGINT)
    lines = sigterm_lines(stderr, "SIGINT")
    assert code == 130 and len(lines) == 1, stderr[-4000:]
    last = parts / "ckpt" / "last.ckpt"
    assert lines[0].startswith(f"aah: stopped by SIGINT after step {INTERRUPT_AT + 1}: its checkpoint is {last}; ")
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert load_checkpoint_file(last)["global_step"] == INTERRUPT_AT + 1

    main(run_args(tiny_args, parts, "--ckpt_path=last"))
    check_resumed(tmp_path)


def test_a_second_sigint_stops_at_once_without_the_save(tmp_path, tiny_args):
    parts = tmp_path / "parts"
    args = run_args(tiny_args, parts, *hold_args(parts, INTERRUPT_AT, second_at_save=True))
    code, stderr = run_and_sigterm(args, parts, second_at_save=True, signum=signal.SIGINT)
    folder = parts / "ckpt"
    lines = [line for line in stderr.splitlines() if line.startswith("aah:")]
    assert code == 130 and lines == [
        f"aah: stopped at once by a second SIGINT: this step is not saved; {folder} holds the last complete checkpoint"
    ], stderr[-4000:]
    assert load_checkpoint_file(folder / "last.ckpt")["global_step"] == INTERRUPT_AT  # the periodic save before it


def test_the_line_names_the_command_to_resume_with():
    stop = SignalStop(59, "runs/quickstart/checkpoints/last.ckpt")
    argv = ["fit", "--config", "configs/quickstart.yaml", "--ckpt_path", "runs/x.ckpt", "--model.gpt.n_layer=2"]
    assert sigterm_report(stop, argv) == (
        "stopped by SIGTERM after step 59: its checkpoint is runs/quickstart/checkpoints/last.ckpt; resume with: "
        "aah fit --config configs/quickstart.yaml --model.gpt.n_layer=2 --ckpt_path last"
    )


def test_the_line_after_slurms_requeue_signal_says_what_rank_0_did():
    stop = SignalStop(7, "run/last.ckpt", signal.SIGUSR1, "SLURM job 42 requeued: it starts again and resumes from it")
    assert stop.code == 138
    assert sigterm_report(stop, ["fit"]) == (
        "stopped by SIGUSR1 (SLURM's requeue signal) after step 7: its checkpoint is run/last.ckpt; SLURM job 42 "
        "requeued: it starts again and resumes from it"
    )


def test_sigint_before_the_trainer_runs_is_one_line_and_130(monkeypatch, capsys):
    import aah_lightning.cli as cli

    def interrupted(argv):  # Ctrl-C while the command line is read and the classes are built
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "check_config_files", interrupted)
    with pytest.raises(SystemExit) as exc:
        main(["fit"])
    assert exc.value.code == 130
    assert capsys.readouterr().err.splitlines() == [
        "aah: interrupted (SIGINT) before training started: nothing was saved"
    ]
