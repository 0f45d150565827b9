import os

import pytest
import torch

from helpers.cli import tiny_cli_args

# One thread, here and in every process a test starts (Lightning's DDP ranks already take one each): the models are
# tiny, and two threads spin-waiting for each other cost more CPU than they save, most of all on a busy machine.
torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"


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
