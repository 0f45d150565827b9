"""The command lines under test: tiny ``aah`` configs and arguments, in-process ``aah`` runs, ``tools/<name>.py`` run in
the test's process, and the environment for ``aah`` subprocesses."""

from __future__ import annotations

import os
import runpy
import sys

import datasets  # noqa: F401  imported now, not first inside a capsys test: its log handler keeps the stream it saw
import pytest
import yaml

from aah_lightning.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_cli_args(tmp_path, *extra, steps=6, source="synthetic", seq_len=32, subcommand="fit"):
    """Arguments for an in-process ``aah <subcommand>`` on a tiny model that finishes in seconds."""
    fit_only = [
        f"--trainer.max_steps={steps}",
        "--trainer.val_check_interval=3",
        "--throughput.window=2",
        "--diagnostics.every_n_steps=2",
    ]
    return [
        subcommand,
        *(fit_only if subcommand == "fit" else []),
        f"--checkpoint.dirpath={tmp_path}/ckpt",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.limit_val_batches=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={tmp_path}/runs",
        "--trainer.logger.init_args.name=tiny",
        "--model.gpt.n_layer=2",
        "--model.gpt.n_head=4",
        "--model.gpt.n_embd=32",
        f"--data.source={source}",
        f"--data.seq_len={seq_len}",
        "--data.batch_size=4",
        "--data.synthetic.documents=64",
        *extra,
    ]


def tiny_config(tmp_path, **sections) -> str:
    """A 2-layer model on the synthetic task: a few steps take about a second on one CPU core."""
    cfg = {
        "seed_everything": 1234,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_steps": 4,
            "val_check_interval": 2,
            "limit_val_batches": 1,
            "log_every_n_steps": 1,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "logger": False,
            "default_root_dir": str(tmp_path / "root"),
        },
        "checkpoint": {"dirpath": str(tmp_path / "ckpts"), "every_n_train_steps": 1},
        "model": {
            "gpt": {"n_layer": 2, "n_head": 2, "n_embd": 32},
            "aah": {"policy": "random", "candidates": [8, 16, 32], "seed": 0},
            "optim": {"lr": 1e-3, "warmup_steps": 2},
        },
        "data": {"source": "synthetic", "seq_len": 32, "batch_size": 4, "synthetic": {"documents": 100}},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    os.makedirs(tmp_path, exist_ok=True)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def cli_error(args: list[str], capsys) -> tuple[int, str]:
    """Run ``aah`` in-process, expecting it to refuse. Returns (exit code, its single error line)."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("aah:")]
    assert len(lines) == 1, err
    return exc.value.code, lines[0]


def train_tiny(tmp_path, *extra: str) -> str:
    """Train the tiny model in-process; returns the checkpoint folder."""
    main(["fit", "--config", tiny_config(tmp_path), *extra])
    return str(tmp_path / "ckpts")


def subprocess_env() -> dict:
    """PYTHONPATH for ``python -m aah_lightning`` subprocesses: the repository (when not pip-installed) and tests/ (for
    callbacks given by class path, ``helpers.resume.Recorder``)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH", "")])
    return env


PYTHON = sys.executable


def run_tool(name: str, *args: str) -> int:
    """``python tools/<name>.py ARGS`` in this process (no new interpreter to start): the tool's exit status, as the
    shell would see it (a message given to sys.exit goes to stderr, status 1)."""
    path = os.path.join(REPO, "tools", f"{name}.py")
    argv = sys.argv
    sys.argv = [path, *args]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = argv
    return 0
