import os

import pytest
import torch

# Two cores: keep torch from oversubscribing when pytest runs alongside data workers.
torch.set_num_threads(min(2, os.cpu_count() or 1))


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
        "--model.n_layer=2",
        "--model.n_head=4",
        "--model.n_embd=32",
        f"--data.source={source}",
        f"--data.seq_len={seq_len}",
        "--data.batch_size=4",
        "--data.synthetic_documents=64",
        *extra,
    ]


@pytest.fixture
def tiny_args(tmp_path):
    return lambda *extra, **kw: tiny_cli_args(tmp_path, *extra, **kw)


@pytest.fixture(autouse=True, scope="session")
def token_cache(tmp_path_factory):
    """Token folders the tests prepare go to a folder of this session, not the user's cache (subprocesses too)."""
    old = os.environ.get("AAH_CACHE_DIR")
    os.environ["AAH_CACHE_DIR"] = str(tmp_path_factory.mktemp("aah_cache"))
    yield os.environ["AAH_CACHE_DIR"]
    if old is None:
        os.environ.pop("AAH_CACHE_DIR")
    else:
        os.environ["AAH_CACHE_DIR"] = old
