"""``fa4_window`` on CPU, with a stand-in for the two functions of flash-attn-4 it calls (helpers/flash_stand_ins.py,
written from FlashAttention's documented semantics). What this checks is aah's side: the window convention, the layouts,
the custom ops and their autograd, the groups, documents as varlen sequences, the layer's weight path, a compiled
block. FlashAttention-4 itself runs on a Hopper GPU only (``tools/gpu_tune.py`` and ``tools/gpu_check.py`` check it
there against the same float64 reference)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from aah_lightning.lit import distributed
from aah_lightning.model.attention import fa4_window, get_backend, registry, resolve_backend
from aah_lightning.model.attention.reference import reference_attention
from aah_lightning.model.attention.registry import AVAILABLE
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from helpers import flash_stand_ins


@pytest.fixture
def stand_in(monkeypatch):
    return flash_stand_ins.install(monkeypatch)


def test_window_size_is_inclusive_and_full_windows_pass_none():
    assert fa4_window.fa4_window_size(1, 64) == (0, 0)  # the query's own key only
    assert fa4_window.fa4_window_size(17, 64) == (16, 0)
    assert fa4_window.fa4_window_size(64, 64) == (None, None)
    assert fa4_window.fa4_window_size(100, 64) == (None, None)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("documents", [False, True])
def test_plan_equals_the_float64_reference_forward_and_backward(stand_in, seed, documents):
    B, H, T, D = 2, 6, 48, 8
    g = torch.Generator().manual_seed(seed)
    row = torch.randint(1, T + 8, (H,), generator=g).tolist()
    row[1] = row[4] = 9  # two heads share a window: one call for both
    sink = (0, 3)[seed]  # with a sink: the same calls, in the varlen layout, merged with the sink keys
    doc_ids = None
    if documents:  # contiguous runs, as packing makes them
        doc_ids = torch.tensor([[0] * 20 + [1] * 28, [3] * 5 + [4] * 40 + [5] * 3])
    plan = get_backend("fa4_window").build(tuple(row), T, doc_ids, device=torch.device("cpu"), block_size=16, sink=sink)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    ours = plan(q, k, v)
    want = reference_attention(q, k, v, row, doc_ids, sink)
    torch.testing.assert_close(ours, want, rtol=1e-10, atol=1e-10)
    d_out = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    mine = torch.autograd.grad(ours, (q, k, v), d_out)
    theirs = torch.autograd.grad(want, (q, k, v), d_out)
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    windowed = {min(w, T) for w in row} - ({T} if not documents else set())
    forward_calls = [c for c in stand_in]
    assert sorted((w for _, w in forward_calls), key=str) == sorted(
        (fa4_window.fa4_window_size(w, T) for w in windowed), key=str
    )  # one forward call per window group
    assert {kind for kind, _ in forward_calls} == {"varlen" if documents or sink else "batch"}


@pytest.mark.parametrize("sink", [0, 2])
def test_model_runs_the_groups_through_its_weights_like_sdpa(stand_in, monkeypatch, sink):
    """The layer runs fa4_window's groups itself (head_groups) and trains exactly like the dense reference backend."""
    monkeypatch.setattr(fa4_window.Fa4WindowBackend, "available", lambda self, device, needs_grad: AVAILABLE)
    T = 32
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=T, n_layer=2, n_head=4, n_embd=32), sink=sink).double()
    model.set_windows(torch.tensor([[5, T, 5, 12], [T, 3, 20, 3]], dtype=torch.int32))
    tokens = torch.randint(model.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))

    def run(backend):
        model.zero_grad()
        logits = model(tokens, plans=model.attention_plans(T, backend=backend))
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    plans = model.attention_plans(T, backend="fa4_window")
    assert all(p.kind == "fa4_window" and p.head_groups.order is not None for p in plans)
    ours, want = run("fa4_window"), run("sdpa")
    torch.testing.assert_close(ours[0], want[0], rtol=1e-10, atol=1e-10)
    for a, b in zip(ours[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert {w for _, w in stand_in} == {(4, 0), (11, 0), (2, 0), (19, 0)}


def test_without_a_hopper_gpu_and_the_package_it_runs_varlen_then_split(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    reason = get_backend("fa4_window").available(cuda, needs_grad=True).reason
    assert "compute capability >= 9.0, this GPU has 8.0" in reason
    registry._logged.clear()
    assert resolve_backend("fa4_window", cuda, needs_grad=True, seq_len=4096) == "varlen"
    assert resolve_backend("fa4_window", torch.device("cpu"), needs_grad=True, seq_len=4096) == "split"
    monkeypatch.setattr(fa4_window.flex, "fa4_missing", lambda device: None)
    assert get_backend("fa4_window").available(cuda, needs_grad=True) == AVAILABLE


@pytest.mark.heavy  # compiles two blocks on CPU (~20 s)
def test_compiled_blocks_call_the_custom_ops_and_train_like_eager(stand_in, monkeypatch):
    """Blocks compile with fullgraph=True: FA4's calls must be graph nodes (the custom ops), not graph breaks."""
    monkeypatch.setattr(fa4_window.Fa4WindowBackend, "available", lambda self, device, needs_grad: AVAILABLE)
    T = 32
    table = torch.tensor([[5, T, 5, 12], [T, 3, 20, 3]], dtype=torch.int32)
    tokens = torch.randint(97, (2, T + 1), generator=torch.Generator().manual_seed(0))

    def step(compiled: bool):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=97, seq_len=T, n_layer=2, n_head=4, n_embd=32, backend="fa4_window"))
        model.set_windows(table)
        if compiled:
            distributed.prepare_model(SimpleNamespace(model=model), compile_blocks=True, activation_checkpointing=False)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        return loss.detach(), [p.grad for p in model.parameters()]

    torch._dynamo.reset()
    eager, compiled = step(False), step(True)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(compiled[1], eager[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert len(stand_in) == 2 * 4  # two runs x (2 layers x 2 windowed groups): every group reached FA4, compiled too
