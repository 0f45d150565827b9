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


# -- several workers (pytest-xdist: `pytest -n auto`; pyproject's addopts holds --dist loadgroup) ----------------------
# Workers are processes: each builds its own module- and session-scoped fixtures. Tests that share such a fixture of
# tests/ (a checkpoint trained once, the DDP reference run, the local SLURM cluster and its jobs) go to one worker in
# one xdist_group, so that it is built once, as in a serial run. Nothing else needs one worker: every multi-process
# test takes a free port, and every test writes under its own tmp_path (each worker has its own base folder and
# AAH_CACHE_DIR).
MAX_WORKERS = 8  # `-n auto` on a large machine: more workers only add start-up cost and memory (~1 GB each)


def pytest_xdist_auto_num_workers(config):
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(count or 1, MAX_WORKERS))


def _shared_fixtures(item, here: str) -> list:
    """The fixtures of tests/ that ``item`` uses and that outlive one test: not pytest's own (base id "") nor this
    file's (base id ``here``; token_cache is every test's)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    shared = []
    for name in getattr(item, "fixturenames", ()):
        defs = info.name2fixturedefs.get(name)
        if defs and defs[-1].scope != "function" and defs[-1].baseid not in ("", here):
            shared.append(defs[-1])
    return shared


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(config, items):
    parent = {}  # union-find over fixtures: tests that share any of them, directly or through others, form one group

    def root(key):
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    here = os.path.relpath(os.path.dirname(os.path.abspath(__file__)), config.rootpath).replace(os.sep, "/")
    uses = []
    for item in items:
        keys = [f"{d.baseid}::{d.argname}" for d in _shared_fixtures(item, here)]
        for key in keys[1:]:
            parent[root(key)] = root(keys[0])
        uses.append(keys)
    for item, keys in zip(items, uses):
        if keys:
            item.add_marker(pytest.mark.xdist_group(root(keys[0]).replace("/", ".")))
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Heavy tests first (xdist hands out the groups, largest first, then single tests in this order): a test of a
        # minute that starts last would leave the other workers idle at the end.
        items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


_SPLIT_GROUPS = pytest.StashKey[str]()


def pytest_collection_finish(session):
    """On a worker of ``--dist loadgroup``: every grouped test's id must carry its group (xdist's mark of a group).
    Where a pytest / pytest-xdist pair drops it, the groups would silently be split across workers and every shared
    fixture built again on each: those tests fail instead, saying why."""
    if not (os.environ.get("PYTEST_XDIST_WORKER") and session.config.getvalue("loadgroup")):
        return
    lost = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        session.config.stash[_SPLIT_GROUPS] = (
            f"pytest-xdist did not mark {len(lost)} grouped tests with their xdist_group: this pytest / pytest-xdist "
            "pair would split tests that share a fixture across workers; install the versions pyproject.toml's dev "
            "extra allows"
        )


def pytest_runtest_setup(item):
    if item.get_closest_marker("xdist_group") and _SPLIT_GROUPS in item.config.stash:
        pytest.fail(item.config.stash[_SPLIT_GROUPS], pytrace=False)
