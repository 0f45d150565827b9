"""Grouped-query attention (``n_kv_head < n_head``): every backend's plans against the float64 reference, forward and
backward, with random per-head windows and attention sinks, and the GPT through each backend's plans against
reference plans.

Query head ``h`` reads key/value head ``h // (H / Hkv)`` and keeps its own window. The reference is checked here
against attention written head by head from the spec; kernels without a CPU implementation run on the stand-ins of
helpers/flash_stand_ins.py, and CPU flex (no backward, slow to compile) runs eager here and compiled forward-only in
a heavy test, as tests/model/test_flex.py does.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from aah_lightning.model import masks
from aah_lightning.model.attention import (
    AttentionPlanner,
    Plan,
    Recording,
    expand_kv,
    fa4_window,
    flex,
    get_backend,
    split,
    varlen,
)
from aah_lightning.model.attention.reference import reference_attention
from aah_lightning.model.attention.registry import AVAILABLE
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from helpers import flash_stand_ins
from helpers.spec import allowed, random_windows

H = 6
KV_HEADS = [1, 2, 3]  # multi-query, two groups of three, three groups of two
SINKS = {1: 0, 2: 3, 3: 17}  # an attention sink per key/value layout: none, a few positions, more than a tile


def gqa_qkv(B, n_kv, T, D=8, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(B, n_kv, T, D, generator=g, dtype=dtype, requires_grad=True) for _ in range(2))
    return q, k, v


def documents(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.cumsum((torch.rand(B, T, generator=g) < 0.05).long(), dim=1)


def assert_matches_reference(out, q, k, v, row, doc_ids=None, tol=1e-9, sink=0):
    ref = reference_attention(q, k, v, torch.tensor(row), doc_ids, sink)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    grad = torch.randn_like(ref)
    got = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    want = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b, rtol=tol * 10, atol=tol * 10)


@pytest.mark.parametrize("n_kv", KV_HEADS)
def test_reference_reads_the_key_value_head_of_each_query_group(n_kv):
    T = 20
    q, k, v = (x.detach() for x in gqa_qkv(2, n_kv, T, seed=n_kv))
    row = [1, 3, 20, 7, 2, 30]
    mask = allowed(row, T)[0]
    out = reference_attention(q, k, v, row)
    for h in range(H):
        kv = h // (H // n_kv)
        s = (q[:, h] @ k[:, kv].transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask[h], float("-inf"))
        torch.testing.assert_close(out[:, h], s.softmax(-1) @ v[:, kv], rtol=1e-12, atol=1e-12)


def test_expand_kv_gives_each_query_head_its_key_value_head():
    x = torch.arange(3.0).view(1, 3, 1, 1).expand(1, 3, 2, 1)  # key/value head j holds the value j
    assert expand_kv(x, 6)[0, :, 0, 0].tolist() == [0, 0, 1, 1, 2, 2]
    order = torch.tensor([5, 0, 3, 2, 1, 4])
    assert expand_kv(x, 6, order)[0, :, 0, 0].tolist() == [2, 0, 1, 1, 0, 2]
    assert expand_kv(x, 3) is x  # nothing to expand: no copy


@pytest.mark.parametrize("n_kv", KV_HEADS)
@pytest.mark.parametrize("backend", ["sdpa", "banded", "split"])
@pytest.mark.parametrize("docs", [False, True])
def test_cpu_backends_match_reference_under_gqa(backend, n_kv, docs):
    T = 150
    g = torch.Generator().manual_seed(n_kv)
    row = tuple(random_windows(H, T, g).tolist())
    row = (3,) + row[1:]  # at least one windowed head, so the plan is the backend's, not causal
    doc_ids = documents(2, T, seed=n_kv) if docs else None
    q, k, v = gqa_qkv(2, n_kv, T, seed=n_kv)
    sink = SINKS[n_kv]
    plan = AttentionPlanner().plans(torch.tensor([row], dtype=torch.int32), T, backend, doc_ids, sink)[0]
    assert plan.kind == {"sdpa": "dense"}.get(backend, backend)
    assert_matches_reference(plan(q, k, v), q, k, v, row, doc_ids, sink=sink)


@pytest.mark.parametrize("n_kv", KV_HEADS)
def test_causal_plan_takes_fewer_key_value_heads(n_kv):
    T = 40
    q, k, v = gqa_qkv(2, n_kv, T, seed=3)
    plan = AttentionPlanner().plans(torch.full((1, H), T, dtype=torch.int32), T, "banded")[0]
    assert plan.kind == "causal"
    assert_matches_reference(plan(q, k, v), q, k, v, (T,) * H)


@pytest.mark.parametrize("n_kv", KV_HEADS)
@pytest.mark.parametrize("docs", [False, True])
def test_varlen_plans_match_reference_under_gqa(monkeypatch, n_kv, docs):
    flash_stand_ins.install_varlen(monkeypatch, varlen)
    T = 90
    g = torch.Generator().manual_seed(10 + n_kv)
    row = (5,) + tuple(random_windows(H - 1, T, g).tolist())  # random, with one windowed head at least
    doc_ids = documents(2, T, seed=1) if docs else None
    sink = SINKS[n_kv]
    plan = varlen.VarlenBackend().build(row, T, doc_ids, device=torch.device("cpu"), block_size=128, sink=sink)
    q, k, v = gqa_qkv(2, n_kv, T, seed=n_kv)
    assert_matches_reference(plan(q, k, v), q, k, v, row, doc_ids, sink=sink)


@pytest.mark.parametrize("n_kv", KV_HEADS)
@pytest.mark.parametrize("docs", [False, True])
def test_fa4_window_plans_match_reference_under_gqa(monkeypatch, n_kv, docs):
    calls = flash_stand_ins.install(monkeypatch)
    T = 48
    g = torch.Generator().manual_seed(20 + n_kv)
    row = (9,) + tuple(random_windows(H - 1, T, g).tolist())
    doc_ids = torch.tensor([[0] * 20 + [1] * 28, [3] * 5 + [4] * 40 + [5] * 3]) if docs else None
    sink = SINKS[n_kv]
    plan = fa4_window.Fa4WindowBackend().build(row, T, doc_ids, device=torch.device("cpu"), block_size=16, sink=sink)
    q, k, v = gqa_qkv(2, n_kv, T, seed=n_kv)
    assert_matches_reference(plan(q, k, v), q, k, v, row, doc_ids, tol=1e-10, sink=sink)
    assert calls  # the groups went through FlashAttention-4's (stand-in) calls


def eager_flex(q, k, v, block_mask=None, kernel_options=None, enable_gqa=False):
    """flex_attention uncompiled, forward only (kernel options are the GPU kernel's, dropped here)."""
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


def dense_flex(q, k, v, block_mask=None, kernel_options=None, enable_gqa=False):
    """flex's semantics with autograd, for the backward: the BlockMask's mask_mod evaluated densely, and fewer
    key/value heads only with ``enable_gqa`` (as flex_attention requires)."""
    assert enable_gqa == (k.shape[1] != q.shape[1])
    B, Hq, T, D = q.shape
    mask = masks.dense_mask(block_mask.mask_mod, 1, Hq, T, q.device)
    k, v = (x.repeat_interleave(Hq // x.shape[1], dim=1) for x in (k, v))
    scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("n_kv", KV_HEADS)
@pytest.mark.parametrize("backend", ["flex", "flex_tuned", "flex_fa4"])
@pytest.mark.parametrize("balanced", [False, True])
def test_flex_plans_match_reference_under_gqa(monkeypatch, backend, n_kv, balanced):
    """Native GQA (``enable_gqa``) in the layer's head order, expanded key/value heads in the balanced CPU order.
    Forward: eager flex itself; backward (none on CPU): flex's semantics evaluated densely. ``flex_fa4`` builds the
    same plan with FLASH's kernel options."""
    monkeypatch.setattr(flex.torch, "get_num_threads", lambda: 2 if balanced else 1)
    T = 256
    row = (4, 8, 16, 256, 256, 256) if balanced else (5, 256, 64, 1, 130, 256)  # balanced: cheap heads first
    sink = SINKS[n_kv] * 3  # up to 51: across two 32-tiles, partial and full
    plan = get_backend(backend).build(row, T, None, device=torch.device("cpu"), block_size=32, sink=sink)
    assert (plan.order is not None) == balanced
    q, k, v = gqa_qkv(1, n_kv, T, seed=n_kv)
    monkeypatch.setattr(flex, "compiled_flex_attention", lambda: eager_flex)
    plain = [x.detach() for x in (q, k, v)]  # flex refuses inputs that require grad on CPU
    want = reference_attention(*plain, row, sink=sink)
    torch.testing.assert_close(plan(*plain), want, rtol=1e-9, atol=1e-9)
    monkeypatch.setattr(flex, "compiled_flex_attention", lambda: dense_flex)
    assert_matches_reference(plan(q, k, v), q, k, v, row, sink=sink)


def test_split_with_flex_parts_matches_reference_under_gqa(monkeypatch):
    monkeypatch.setattr(flex, "compiled_flex_attention", lambda: dense_flex)
    T = 200
    row = (3, 200, 64, 130, 999, 1)
    q, k, v = gqa_qkv(2, 2, T)
    plan = split.SplitBackend(windowed="flex").build(row, T, None, device=torch.device("cpu"), block_size=128)
    assert_matches_reference(plan(q, k, v), q, k, v, row)


@pytest.mark.heavy  # compiles flex on CPU
@pytest.mark.parametrize("n_kv", [1, 2])
def test_compiled_flex_forward_under_gqa(n_kv):
    T = 256
    row = (5, 256, 64, 1, 130, 256)
    q, k, v = (x.detach().float() for x in gqa_qkv(1, n_kv, T, D=16, seed=n_kv))
    with torch.no_grad():
        out = flex.build_flex_plan(row, T, None, torch.device("cpu"), 128, balance=False)(q, k, v)
    torch.testing.assert_close(out.double(), reference_attention(q, k, v, row), rtol=2e-5, atol=2e-5)


# -- the GPT under GQA -------------------------------------------------------------------------------------------------
class Reference(Plan):
    """The float64 reference attention of one layer's windows (no head groups: the layer passes Hkv heads)."""

    def __init__(self, row, sink=0):
        self.row, self.sink = row, sink

    def __call__(self, q, k, v):
        assert k.shape[1] < q.shape[1]  # the layer really hands over fewer key/value heads
        return reference_attention(q, k, v, torch.tensor(self.row), sink=self.sink)


def gqa_model(n_kv, T=64, seed=0, sink=0, **kw):
    torch.manual_seed(seed)
    cfg = GPTConfig(seq_len=T, n_layer=2, n_head=H, n_kv_head=n_kv, n_embd=H * 8, **kw)
    model = GPT(cfg, sink=sink).double()
    g = torch.Generator().manual_seed(seed)
    table = torch.randint(1, T, (2, H), generator=g, dtype=torch.int32)
    table[:, ::3] = T  # full heads between windowed ones: split groups cut across key/value groups
    model.set_windows(table)
    for p in model.parameters():  # biases and norm weights away from their initial values
        if p.dim() == 1:
            p.data.normal_(0, 0.2, generator=g)
    return model


def run(model, tokens, plans):
    model.zero_grad()
    logits = model(tokens, plans=plans)
    logits.square().mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("n_kv", [1, 2])
@pytest.mark.parametrize("backend", ["sdpa", "banded", "split", "fa4_window"])
def test_gpt_under_gqa_equals_the_reference_forward_and_backward(monkeypatch, backend, n_kv):
    flash_stand_ins.install(monkeypatch)
    monkeypatch.setattr(fa4_window.Fa4WindowBackend, "available", lambda self, device, needs_grad: AVAILABLE)
    T = 64
    sink = 5 if n_kv == 2 else 0
    model = gqa_model(n_kv, T, seed=n_kv, sink=sink, qkv_bias=True, qk_norm=True, norm="rmsnorm", mlp="swiglu")
    assert model.blocks[0].attn.qkv.weight.shape[0] == (H + 2 * n_kv) * 8
    tokens = torch.randint(model.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(0))
    plans = model.attention_plans(T, backend=backend)
    if backend in ("split", "fa4_window"):  # the layer's weight path: query heads reordered across kv groups
        assert all(p.head_groups is not None and p.head_groups.order is not None for p in plans)
    ours = run(model, tokens, plans)
    want = run(model, tokens, [Reference(tuple(r.tolist()), sink) for r in model.windows])
    torch.testing.assert_close(ours[0], want[0], rtol=1e-10, atol=1e-10)
    for name in want[1]:
        torch.testing.assert_close(ours[1][name], want[1][name], rtol=1e-9, atol=1e-10, msg=name)


def test_gqa_with_one_key_value_head_per_query_head_is_the_default_model():
    """n_kv_head = n_head is the default model: the same parameters, names and outputs."""
    torch.manual_seed(0)
    default = GPT(GPTConfig(seq_len=32, n_layer=2, n_head=4, n_embd=32))
    torch.manual_seed(0)
    explicit = GPT(GPTConfig(seq_len=32, n_layer=2, n_head=4, n_embd=32, n_kv_head=4))
    assert default.state_dict().keys() == explicit.state_dict().keys()
    tokens = torch.randint(257, (1, 32))
    torch.testing.assert_close(default(tokens), explicit(tokens), rtol=0, atol=0)


def test_the_probe_sees_every_query_head_with_its_key_value_head():
    """Recording (the probe's plan) expands the key/value heads: the probe reads each query head's keys."""
    from aah_lightning.windows.probe import mass_within, run_probe

    T = 32
    model = gqa_model(2, T, seed=4)
    tokens = torch.randint(model.cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        result = run_probe(model, tokens, n_queries=8, generator=torch.Generator().manual_seed(0))
        plain = model(tokens)
        recorded = model(tokens, plans=[Recording(p) for p in model.attention_plans(T)])
    torch.testing.assert_close(recorded, plain, rtol=0, atol=0)  # recording changes nothing
    for k in result.k:
        assert k.shape == (2, H, T, 8)
        assert torch.equal(k[:, 0], k[:, 2]) and torch.equal(k[:, 3], k[:, 5])  # one key/value head per group of 3
        assert not torch.equal(k[:, 2], k[:, 3])
    full = mass_within(result, torch.full((2, H), T))
    torch.testing.assert_close(full, torch.ones_like(full), rtol=0, atol=1e-6)


@pytest.mark.heavy  # compiles two blocks on CPU
def test_compiled_llama_blocks_under_gqa_train_like_eager():
    from types import SimpleNamespace

    from aah_lightning.lit import distributed

    T = 32
    table = torch.tensor([[5, T, 5, 12, T, 3], [T, 3, 20, 3, 7, T]], dtype=torch.int32)
    tokens = torch.randint(97, (2, T + 1), generator=torch.Generator().manual_seed(0))
    settings = dict(n_kv_head=2, mlp="swiglu", norm="rmsnorm", qk_norm=True, qkv_bias=True, tie_embeddings=False)

    def step(compiled: bool):
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=97, seq_len=T, n_layer=2, n_head=H, n_embd=48, backend="split", **settings)
        model = GPT(cfg)
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
