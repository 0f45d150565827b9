import os

import pytest
import torch

from helpers.cli import tiny_cli_args

# Two cores: keep torch from oversubscribing when pytest runs alongside data workers.
torch.set_num_threads(min(2, os.cpu_count() or 1))


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


@pytest.fixture
def one_thread():
    """Train tiny models on one thread: faster, and on a busy machine two spin-waiting threads cost 10x."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
