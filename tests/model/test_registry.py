"""The backend interface: registry, ``auto`` rules, fallbacks, and what plans report to diagnostics."""

import logging

import pytest
import torch

from aah_lightning.errors import ConfigError
from aah_lightning.model import masks, window_math
from aah_lightning.model.attention import (
    AUTO_RULES,
    AttentionPlanner,
    Backend,
    BackendUnavailable,
    backend_names,
    get_backend,
    register,
    registry,
    resolve_backend,
)
from aah_lightning.model.attention.banded import band_pairs
from aah_lightning.model.attention.reference import reference_attention
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from aah_lightning.model.masks import dense_mask, window_mask_mod

CPU = torch.device("cpu")


def test_every_backend_is_selectable_and_unknown_names_are_refused():
    names = backend_names()
    assert names[0] == "auto" and {"sdpa", "banded", "flex", "flex_tuned", "flex_fa4"} <= set(names)
    for name in names:
        GPTConfig(backend=name)  # accepted by the config
    with pytest.raises(ConfigError, match="model.gpt.backend"):
        GPTConfig(backend="nope")
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        get_backend("nope")


@pytest.mark.parametrize(
    "device,needs_grad,seq_len,expected",
    [
        ("cpu", True, 4096, "banded"),
        ("cpu", False, 4096, "banded"),
        ("cpu", True, 255, "sdpa"),
        ("cpu", True, 256, "banded"),
        ("cuda", True, 64, "flex_tuned"),
        ("cuda", False, 16384, "flex_tuned"),
    ],
)
def test_auto_follows_the_documented_rule(device, needs_grad, seq_len, expected):
    assert resolve_backend("auto", torch.device(device), needs_grad, seq_len) == expected
    # the rule is the table: its first available entry whose minimum length is reached
    rule = next(name for name, least in AUTO_RULES[device] if seq_len >= least)
    assert rule == expected


def test_a_missing_kernel_falls_back_with_one_log_line(caplog):
    registry._logged.clear()
    with caplog.at_level(logging.WARNING, logger=registry.__name__):
        first = resolve_backend("flex_fa4", CPU, needs_grad=False, seq_len=512)
        second = resolve_backend("flex_fa4", CPU, needs_grad=False, seq_len=512)
    assert first == second == "flex_tuned"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "model.gpt.backend=flex_fa4 unavailable" in lines[0] and "using flex_tuned" in lines[0]
    # the fallback cannot train on CPU either: the chain ends in a refusal that names what to use instead
    with pytest.raises(BackendUnavailable, match="cannot train on cpu.*model.gpt.backend=auto"):
        resolve_backend("flex_fa4", CPU, needs_grad=True, seq_len=512)


@pytest.fixture
def float64_reference_backend():
    """A backend added in one class, as a new kernel module would: the float64 dense reference."""

    class ReferencePlan(registry.Plan):
        kind = "reference"

        def __init__(self, row, seq_len):
            self.row, self.seq_len = row, seq_len

        def __call__(self, q, k, v):
            return reference_attention(q, k, v, torch.tensor(self.row)).to(q.dtype)

    @register
    class ReferenceBackend(Backend):
        name = "test_reference"

        def build(self, row, seq_len, doc_ids, *, device, block_size):
            return ReferencePlan(row, seq_len)

    yield ReferenceBackend.name
    del registry._BACKENDS[ReferenceBackend.name]


def test_a_new_backend_is_one_class_and_runs_in_the_model(float64_reference_backend):
    with pytest.raises(ValueError, match="taken"):
        register(type("Again", (Backend,), {"name": float64_reference_backend}))
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, seq_len=48, n_layer=2, n_head=4, n_embd=32)).double()
    model.set_windows([[3, 48, 17, 1], [48, 48, 48, 48]])
    x = torch.randint(0, 50, (2, 48))
    ours = model(x, backend=float64_reference_backend)
    kinds = [p.kind for p in model.attention_plans(48, backend=float64_reference_backend)]
    assert kinds == ["reference", "causal"]  # a layer of full windows is causal under every backend
    torch.testing.assert_close(ours, model(x, backend="sdpa"))
    # its build takes no sink: a model with one is refused in one line, not run without it
    model.sink = 2
    with pytest.raises(BackendUnavailable, match="backend=test_reference takes no attention sink.*model.aah.sink=2"):
        model(x, backend=float64_reference_backend)


@pytest.mark.parametrize("sink", [0, 4, 130])
@pytest.mark.parametrize("backend", ["sdpa", "banded", "flex"])
def test_plans_report_their_tiles_and_pairs(backend, sink):
    T, tile = 700, 128
    row = (1, 64, 127, 129, 300, 700, 5000)
    with torch.no_grad():  # flex plans build on CPU for inference
        plan = AttentionPlanner(tile).plans(torch.tensor([row], dtype=torch.int32), T, backend, sink=sink)[0]
    counts = plan.tile_counts(tile)
    partial, full = window_math.window_tiles(torch.tensor(row), T, tile, sink)
    assert (counts.partial, counts.full) == (int(partial.sum()), int(full.sum()))
    assert counts.causal == len(row) * window_math.causal_tiles(T, tile)
    assert counts.source == ("blockmask" if backend == "flex" else "analytic")
    # the pairs a sink adds, counted from the mask itself
    assert plan.pairs() == int(dense_mask(window_mask_mod(torch.tensor(row), sink=sink), 1, len(row), T, "cpu").sum())
    assert plan.pairs() == sum(window_math.window_pairs(w, T, sink) for w in row)
    assert (plan.pairs() > sum(window_math.window_pairs(w, T) for w in row)) == (sink > 0)
    computed = {
        "sdpa": len(row) * T * T,
        "banded": sum(band_pairs(w, T, sink) for w in row),
        "flex": (counts.partial + counts.full) * tile * tile,
    }[backend]
    assert plan.computed_pairs(tile) == computed
    assert plan.pairs() <= computed


@pytest.mark.parametrize("sink", [0, 70])
def test_blockmask_tiles_match_the_analytic_count(sink):
    row = torch.tensor([1, 100, 128, 129, 1000], dtype=torch.int32)
    counted = masks.block_mask_tiles(masks.window_block_mask(row, 1000, 64, sink))
    analytic = window_math.tile_counts(row, 1000, 64, sink)
    assert (counted.partial, counted.full, counted.causal) == (analytic.partial, analytic.full, analytic.causal)
    assert counted.source == "blockmask" and 0 < counted.density < 1


def test_default_candidates_are_t_over_8_4_2_and_t_like_the_policies_use():
    from aah_lightning.windows.config import AAHConfig

    assert window_math.default_candidates(4096) == [512, 1024, 2048, 4096]
    assert window_math.default_candidates(4) == [1, 2, 4]  # no repeats, never 0
    for T in (1, 4, 100, 4096):
        assert window_math.default_candidates(T) == AAHConfig().resolved_candidates(T)


def test_fa4_needs_hopper_and_the_package(monkeypatch):
    """What flex_fa4 says on a CUDA machine (faked: this one has none) without sm90 or without flash_attn.cute."""
    from aah_lightning.model.attention import flex

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "compute capability >= 9.0, this GPU has 8.0" in flex.fa4_missing(cuda)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def no_package(name):
        raise ModuleNotFoundError(f"No module named {name!r}")

    monkeypatch.setattr(flex.importlib, "import_module", no_package)
    assert "flash_attn.cute does not import" in flex.fa4_missing(cuda) and ".[fa4]" in flex.fa4_missing(cuda)
    registry._logged.clear()
    assert resolve_backend("flex_fa4", cuda, needs_grad=True, seq_len=4096) == "flex_tuned"
    monkeypatch.setattr(flex.importlib, "import_module", lambda name: None)  # the package imports
    assert flex.fa4_missing(cuda) is None
    assert resolve_backend("flex_fa4", cuda, needs_grad=True, seq_len=4096) == "flex_fa4"
    assert flex.tuned_options((7, 5), 64, torch.bfloat16) == flex.DEFAULT_TUNED_OPTIONS  # nothing pinned there
    assert flex.tuned_options(None, 64, torch.float32) == {}  # CPU: no options


def test_tuned_options_never_hold_the_options_our_masks_break():
    """ROWS_GUARANTEED_SAFE made flex return NaN on an H200 (a window edge's partial tile, visited first, can hide
    every key from some of its rows) and BLOCKS_ARE_CONTIGUOUS assumes adjacent tiles: neither may be pinned."""
    from aah_lightning.model.attention import flex

    for options in [flex.DEFAULT_TUNED_OPTIONS, *flex.TUNED_OPTIONS.values()]:
        assert not {"ROWS_GUARANTEED_SAFE", "BLOCKS_ARE_CONTIGUOUS"} & set(options)
