"""Crash-safe checkpoint writes and safe loading (aah_lightning/lit/atomic_files.py), the checkpoint folder's lock
(lit/folder_lock.py) and ``last.ckpt`` (lit/last_checkpoint.py)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import signal
import socket
import subprocess
import textwrap
import time
import warnings

import lightning as L
import pytest
import torch

from aah_lightning import atomic
from aah_lightning.atomic import PARTIAL_PREFIX
from aah_lightning.checkpoint import load_checkpoint_file
from aah_lightning.cli import AAHCLI, main
from aah_lightning.errors import CheckpointWriteError, ConfigError
from aah_lightning.lit import folder_lock
from aah_lightning.lit.atomic_files import AtomicCheckpointIO
from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.last_checkpoint import LastCheckpoint
from aah_lightning.lit.module import AAHModule
from aah_lightning.model.config import GPTConfig
from aah_lightning.preflight import resolve_ckpt_path
from aah_lightning.windows.config import AAHConfig
from aah_lightning.windows.policy_base import available_policies
from helpers import disks
from helpers.cli import PYTHON, cli_error, subprocess_env, tiny_config, train_tiny

STALLING_WRITER = textwrap.dedent(
    """
    import io, sys, time, torch
    from aah_lightning.lit.atomic_files import AtomicCheckpointIO

    path, plugin = sys.argv[1], AtomicCheckpointIO()
    plugin.save_checkpoint({"version": 1, "w": torch.full((1 << 18,), 1.0)}, path)
    real_save = torch.save

    def stalling_save(obj, f):  # writes half of the archive, then hangs until it is killed
        buf = io.BytesIO()
        real_save(obj, buf)
        data = buf.getvalue()
        f.write(data[: len(data) // 2])
        f.flush()
        print("HALF", flush=True)
        time.sleep(600)
        f.write(data[len(data) // 2 :])

    torch.save = stalling_save
    plugin.save_checkpoint({"version": 2, "w": torch.full((1 << 18,), 2.0)}, path)
    """
)


def test_writer_killed_mid_write_leaves_the_previous_checkpoint_intact(tmp_path):
    script, target = tmp_path / "writer.py", tmp_path / "ckpts" / "last.ckpt"
    script.write_text(STALLING_WRITER)
    proc = subprocess.Popen([PYTHON, str(script), str(target)], stdout=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        assert proc.stdout.readline().strip() == "HALF"
        partials = [p for p in os.listdir(target.parent) if p.startswith(PARTIAL_PREFIX)]
        assert len(partials) == 1 and os.path.getsize(target.parent / partials[0]) > 0  # really mid-write
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    ckpt = load_checkpoint_file(target)  # complete archive, checksums verified
    assert ckpt["version"] == 1 and torch.equal(ckpt["w"], torch.full((1 << 18,), 1.0))
    # The next save on this host removes the dead writer's leftover and replaces the file.
    AtomicCheckpointIO().save_checkpoint({"version": 3}, target)
    assert load_checkpoint_file(target)["version"] == 3
    assert sorted(os.listdir(target.parent)) == ["last.ckpt"]


@pytest.fixture
def small_disk(tmp_path):
    """A real 600 KiB file system (a tmpfs: room for one tiny checkpoint, not for the next one beside it), or a skip
    where this machine does not let the test mount one (not root, no CAP_SYS_ADMIN); the fake below still runs."""
    with disks.small_disk(tmp_path / "small_disk", "600k") as folder:
        yield folder


def test_a_full_disk_during_a_save_is_one_line_exit_4_and_keeps_the_previous_checkpoint(tmp_path, small_disk, capsys):
    folder = small_disk / "ckpts"
    code, line = cli_error(
        ["fit", "--config", tiny_config(tmp_path), f"--checkpoint.dirpath={folder}", "--trainer.max_steps=4"], capsys
    )
    assert code == 4, line
    assert re.search(
        rf"no space left in {re.escape(str(folder))} \(the checkpoint needs about 0\.\d MiB, 0\.\d MiB free\); "
        r"the previous checkpoint there \(if any\) is intact",
        line,
    ), line
    assert os.listdir(folder) == ["last.ckpt"]  # no partial file left behind
    assert load_checkpoint_file(folder / "last.ckpt")["global_step"] == 1  # the save before the failed one, whole


class _NoRoom:  # os.statvfs of a full disk
    f_bavail, f_frsize = 0, 4096


@pytest.mark.parametrize(
    "error, message",
    [
        (OSError(errno.ENOSPC, "No space left on device"), "no space left in "),
        # torch 2.13's form of ENOSPC: no errno; the disk is full when less is free than the rest of the file
        (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), "no space left in "),
        (OSError(errno.EIO, "Input/output error"), "Input/output error; the previous checkpoint there"),
    ],
)
def test_failed_write_reports_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, error, message):
    """The fake counterpart of the small-disk test, for machines that cannot mount one, and the other write errors."""
    target = tmp_path / "last.ckpt"
    plugin = AtomicCheckpointIO()
    plugin.save_checkpoint({"version": 1}, target)

    def failing_save(obj, f):
        f.write(b"PK\x03\x04 partial bytes")
        raise error

    monkeypatch.setattr(atomic.torch, "save", failing_save)
    if isinstance(error, RuntimeError):
        monkeypatch.setattr(atomic.os, "statvfs", lambda folder: _NoRoom, raising=False)
    with pytest.raises(CheckpointWriteError, match=message) as raised:
        plugin.save_checkpoint({"version": 2, "w": torch.zeros(1 << 18)}, target)
    if "space" in message:
        assert f"in {tmp_path} (the checkpoint needs about 1.0 MiB" in str(raised.value)
    monkeypatch.undo()
    assert load_checkpoint_file(target)["version"] == 1
    assert os.listdir(tmp_path) == ["last.ckpt"]  # the partial file was removed


def test_a_runtime_error_that_is_not_a_write_failure_is_not_reported_as_one(tmp_path, monkeypatch):
    def broken_save(obj, f):
        raise RuntimeError("something else went wrong")

    monkeypatch.setattr(atomic.torch, "save", broken_save)
    with pytest.raises(RuntimeError, match="something else") as raised:
        AtomicCheckpointIO().save_checkpoint({"version": 2}, tmp_path / "last.ckpt")
    assert not isinstance(raised.value, CheckpointWriteError)
    assert os.listdir(tmp_path) == []


def test_cli_runs_save_through_the_atomic_plugin(tmp_path):
    cli = AAHCLI(
        AAHModule, TextDataModule, run=False, auto_configure_optimizers=False, args=["--config", tiny_config(tmp_path)]
    )
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    assert [type(cb) for cb in cli.trainer.checkpoint_callbacks][:1] == [LastCheckpoint]


def _save_step(path, step: int, mtime: int) -> None:
    torch.save({"global_step": step, "state_dict": {}}, path)
    os.utime(path, (mtime, mtime))


def test_last_is_the_highest_step_that_verifies_not_the_newest_file(tmp_path):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    _save_step(folder / "last.ckpt", 8, 1000)
    _save_step(folder / "last-v1.ckpt", 4, 2000)  # a stale copy, touched after the newer step was written
    _save_step(folder / "best-step9.ckpt", 9, 3000)  # not a last checkpoint
    damaged = folder / "last-v2.ckpt"
    damaged.write_bytes((folder / "last.ckpt").read_bytes()[:100])  # truncated, newest of all
    os.utime(damaged, (4000, 4000))
    (folder / f"{PARTIAL_PREFIX}host-1-abcd").write_bytes(b"x")
    trainer = L.Trainer(callbacks=[LastCheckpoint(dirpath=str(folder))], logger=False)
    with pytest.warns(UserWarning, match=f"skipping {damaged}: it does not verify"):
        assert resolve_ckpt_path(trainer, "last") == str(folder / "last.ckpt")


def test_a_damaged_last_is_refused_naming_the_newest_checkpoint_that_verifies(tmp_path, capsys):
    folder = train_tiny(tmp_path, "--trainer.max_steps=4")  # last.ckpt (step 4), best-step4.ckpt
    os.remove(os.path.join(folder, "best-step4.ckpt"))
    _save_step(os.path.join(folder, "best-step2.ckpt"), 2, 1000)
    _save_step(os.path.join(folder, "best-step3.ckpt"), 3, 900)
    last = os.path.join(folder, "last.ckpt")
    with open(last, "r+b") as f:  # one flipped byte inside the archive: the CRC no longer matches
        f.seek(os.path.getsize(last) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    for ckpt_path in ("last", last):
        code, line = cli_error(["fit", "--config", tiny_config(tmp_path), "--ckpt_path", ckpt_path], capsys)
        assert code == 2 and f"ckpt_path={last!r} is corrupt" in line, line
        best = os.path.join(folder, "best-step3.ckpt")
        assert line.endswith(f"use an earlier checkpoint: the newest in that folder that verifies is {best} (step 3)")


def test_resumes_keep_one_last_checkpoint_of_the_right_step(tmp_path):
    """A resume with another save interval, and one from a copied folder whose files are all newer than the run,
    write last.ckpt (no last-v1.ckpt beside it) and resume from the highest step."""
    config = tiny_config(tmp_path)
    first = tmp_path / "first"
    main(["fit", "--config", config, f"--checkpoint.dirpath={first}", "--trainer.max_steps=4"])
    main(
        ["fit", "--config", config, f"--checkpoint.dirpath={first}", "--trainer.max_steps=6"]
        + ["--checkpoint.every_n_train_steps=3", "--ckpt_path=last"]
    )
    assert sorted(n for n in os.listdir(first) if n.startswith("last")) == ["last.ckpt"]
    assert load_checkpoint_file(first / "last.ckpt")["global_step"] == 6

    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(first), str(copy)], check=True)  # new modification times
    main(["fit", "--config", config, f"--checkpoint.dirpath={copy}", "--trainer.max_steps=8", "--ckpt_path=last"])
    assert sorted(n for n in os.listdir(copy) if n.startswith("last")) == ["last.ckpt"]
    assert load_checkpoint_file(copy / "last.ckpt")["global_step"] == 8
    assert not [n for n in os.listdir(copy) if "-v" in n]  # no best-step*-v1.ckpt either


@pytest.mark.parametrize("policy", sorted(available_policies()))
def test_checkpoints_of_every_policy_load_weights_only(tmp_path, policy):
    aah = AAHConfig(
        policy=policy,
        candidates=[8, 16, 32],
        fixed={"window": 16},
        static={"table": [[8, 32], [16, 8]]},
        random={"table": [[8, 32], [16, 8]], "redraw_interval": 1},
        shuffle={"redraw_interval": 1},
        span={"target_acr": 0.5, "width": 8, "freeze_at": 2},  # learned_span: learns, then freezes (state saved)
    )
    if hasattr(aah, "controller"):  # the adaptive policy: decide at every step, so its state is not empty
        schedule, need = aah.controller.schedule, aah.controller.need
        schedule.warmup_steps, schedule.control_interval, need.probe_queries = 1, 1, 8
    model = AAHModule(gpt=GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=32, vocab_size=65), aah=aah)
    data = TextDataModule(source="synthetic", seq_len=32, batch_size=4, synthetic={"documents": 100})
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        plugins=[AtomicCheckpointIO()],
        callbacks=[LastCheckpoint(dirpath=str(tmp_path), every_n_train_steps=1)],
    )
    trainer.fit(model, datamodule=data)
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)  # plain torch, no allow-listing
    assert ckpt["global_step"] == 3 and "aah_policy" in ckpt
    assert torch.equal(ckpt["state_dict"]["model.windows"], model.model.windows)


def test_unsafe_checkpoint_is_refused_unless_allowed(tmp_path, capsys):
    folder = train_tiny(tmp_path / "first", "--trainer.max_steps", "2")
    ckpt = torch.load(os.path.join(folder, "last.ckpt"), weights_only=True)
    ckpt["note"] = argparse.Namespace(source="someone else's pickle")  # not a tensor or plain value
    unsafe = tmp_path / "unsafe.ckpt"
    torch.save(ckpt, unsafe)

    code, line = cli_error(["fit", "--config", tiny_config(tmp_path), "--ckpt_path", str(unsafe)], capsys)
    assert code == 2 and "argparse.Namespace" in line and "--weights_only false" in line
    assert not os.path.exists(tmp_path / "ckpts")

    # Explicitly allowed: the run resumes from it (step 2) and finishes.
    main(
        [
            "fit",
            "--config",
            tiny_config(tmp_path),
            "--ckpt_path",
            str(unsafe),
            "--weights_only",
            "false",
            "--trainer.max_steps",
            "3",
        ]
    )
    assert torch.load(tmp_path / "ckpts" / "last.ckpt", weights_only=True)["global_step"] == 3


# -- one run per checkpoint folder -------------------------------------------------------------------------------------
LOCK_HOLDER = textwrap.dedent(
    """
    import sys, time
    from aah_lightning.lit.folder_lock import FolderLock

    FolderLock(sys.argv[1]).acquire()
    print("HELD", flush=True)
    time.sleep(600)
    """
)


def _hold_lock(tmp_path, folder) -> subprocess.Popen:
    """Another process holding ``folder``'s lock, as a running ``aah fit`` does."""
    script = tmp_path / "holder.py"
    script.write_text(LOCK_HOLDER)
    proc = subprocess.Popen([PYTHON, str(script), str(folder)], stdout=subprocess.PIPE, text=True, env=subprocess_env())
    assert proc.stdout.readline().strip() == "HELD"
    return proc


def test_a_second_run_on_a_checkpoint_folder_is_refused_naming_the_first(tmp_path, capsys):
    folder = tmp_path / "ckpts"
    holder = _hold_lock(tmp_path, folder)
    try:
        code, line = cli_error(["fit", "--config", tiny_config(tmp_path)], capsys)
    finally:
        holder.kill()
        holder.wait()
    assert code == 2, line
    assert line.startswith(
        f"aah: error: checkpoint.dirpath={str(folder)!r} is in use by another run: PID {holder.pid} "
    )
    assert f"on host {socket.gethostname()} (started " in line and "give this run another checkpoint.dirpath" in line
    assert not [n for n in os.listdir(folder) if n.endswith(".ckpt")]  # nothing was trained or written


def test_a_killed_runs_lock_is_taken_over(tmp_path):
    folder = tmp_path / "ckpts"
    holder = _hold_lock(tmp_path, folder)
    holder.send_signal(signal.SIGKILL)  # as the OOM killer or a scheduler's SIGKILL would
    holder.wait()
    assert os.path.exists(folder / folder_lock.LOCK_NAME)
    with pytest.warns(UserWarning, match=f"took over the lock of PID {holder.pid} on host"):
        train_tiny(tmp_path, "--trainer.max_steps=2")
    assert load_checkpoint_file(folder / "last.ckpt")["global_step"] == 2
    assert not os.path.exists(folder / folder_lock.LOCK_NAME)  # released when the run ended


@pytest.mark.parametrize("silent_for, taken", [(10, False), (3600, True)])
def test_a_lock_of_another_host_is_stale_when_its_heartbeat_stops(tmp_path, silent_for, taken):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    lock = folder / folder_lock.LOCK_NAME
    lock.write_text(json.dumps({"host": "node-elsewhere", "pid": 4242, "started": 0, "id": "theirs"}))
    os.utime(lock, (time.time() - silent_for,) * 2)
    mine = folder_lock.FolderLock(str(folder))
    if taken:
        with pytest.warns(UserWarning, match="took over the lock of PID 4242 on host node-elsewhere"):
            mine.acquire()
        assert mine.held()
        mine.release()
        assert not lock.exists()
    else:
        with pytest.raises(ConfigError, match="in use by another run: PID 4242 on host node-elsewhere"):
            mine.acquire()
        assert json.loads(lock.read_text())["id"] == "theirs"  # untouched


def test_a_run_that_lost_its_folder_stops_before_its_next_save_naming_the_new_holder(tmp_path, capsys, monkeypatch):
    """A run stopped past its lock's heartbeat (here: the heartbeat made stale by hand) whose folder another process
    then took over: its next save checks the lock first, and the run stops in one line (exit code 4), writing
    nothing, leaving the other run's lock in place."""
    from helpers.takeover import TakeOver

    monkeypatch.setattr(folder_lock.FolderLock, "HEARTBEAT_S", 3600.0)  # no heartbeat of this run in between
    folder = tmp_path / "ckpts"
    args = ["fit", "--config", tiny_config(tmp_path), "--trainer.max_steps=4"]
    args += ["--trainer.callbacks+=helpers.takeover.TakeOver", f"--trainer.callbacks.folder={tmp_path}"]
    try:
        code, line = cli_error(args, capsys)
        (holder,) = TakeOver.holders
        assert code == 4, line
        assert line.startswith(
            f"aah: error: checkpoint.dirpath={str(folder)!r} is no longer this run's: PID {holder.pid} "
        )
        assert f"on host {socket.gethostname()} holds it now (started " in line
        assert line.endswith("so it stops here and writes nothing more there"), line
        assert load_checkpoint_file(folder / "last.ckpt")["global_step"] == 1  # step 2 was not written
        assert sorted(os.listdir(folder)) == [folder_lock.LOCK_NAME, "last.ckpt"]  # no temporary file either
        assert json.loads((folder / folder_lock.LOCK_NAME).read_text())["pid"] == holder.pid  # theirs, kept
    finally:
        for proc in TakeOver.holders:
            proc.kill()
            proc.wait()
        TakeOver.holders.clear()


def test_a_fresh_run_says_nothing_of_its_own_lock_but_a_line_of_another_runs_checkpoints(tmp_path):
    def warnings_of(*extra) -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            main(["fit", "--config", tiny_config(tmp_path), *extra])
        said = [str(w.message) for w in caught]
        return [m for m in said if "not empty" in m or m.startswith("checkpoint.dirpath=")]

    folder = tmp_path / "ckpts"
    assert warnings_of("--trainer.max_steps=2") == []  # the folder holds this run's lock only
    (again,) = warnings_of("--trainer.max_steps=2")  # a second run, not a resume, on the first one's checkpoints
    assert again == (
        f"checkpoint.dirpath={str(folder)!r} holds checkpoints of an earlier run (best-step2.ckpt, last.ckpt) that "
        "this run does not continue: its own go beside them, and over those of the same name (last.ckpt); to go on "
        "from them pass --ckpt_path last, else give this run another checkpoint.dirpath"
    )
    assert warnings_of("--trainer.max_steps=4", "--ckpt_path=last") == []  # the run that continues them


def test_the_run_holds_the_lock_while_it_trains_and_keeps_it_alive(tmp_path, monkeypatch):
    monkeypatch.setattr(folder_lock.FolderLock, "HEARTBEAT_S", 0.01)
    folder = tmp_path / "ckpts"
    seen = []

    class Look(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            lock = folder / folder_lock.LOCK_NAME
            os.utime(lock, (0, 0))  # a heartbeat must bring it back to now
            time.sleep(0.2)
            seen.append((json.loads(lock.read_text())["pid"], time.time() - os.path.getmtime(lock)))

    model = AAHModule(gpt=GPTConfig(n_layer=1, n_head=2, n_embd=16, seq_len=16, vocab_size=65))
    data = TextDataModule(source="synthetic", seq_len=16, batch_size=2, synthetic={"documents": 50})
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[LastCheckpoint(dirpath=str(folder), every_n_train_steps=1), Look()],
    )
    trainer.fit(model, datamodule=data)
    assert [pid for pid, _ in seen] == [os.getpid()] * 2 and all(age < 60 for _, age in seen), seen
    assert not os.path.exists(folder / folder_lock.LOCK_NAME)


def test_the_fsdp2_strategy_keeps_the_class_path_of_earlier_configs():
    # The shipped FSDP2 config names the strategy's module; configs of earlier versions (and the config.yaml each run
    # saves in its log folder) name the module it lived in before, which is kept as an alias.
    import importlib

    import yaml

    from aah_lightning.lit.fsdp2_saves import AtomicModelParallelStrategy

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "configs", "cluster", "fsdp2.yaml")) as f:
        class_path = yaml.safe_load(f)["trainer"]["strategy"]["class_path"]
    for path in (class_path, "aah_lightning.lit.checkpointing.AtomicModelParallelStrategy"):
        module, name = path.rsplit(".", 1)
        assert getattr(importlib.import_module(module), name) is AtomicModelParallelStrategy
