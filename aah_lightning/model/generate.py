"""Text generation with a per-head window KV cache: prefill, one-token decode steps, sampling.

A head with window ``W`` never attends to a key more than ``W - 1`` positions back, so its cache is a ring buffer of
``S = min(W, max_len)`` slots (``max_len``: the longest prompt plus ``max_new_tokens``): the key of position ``p``
lives in slot ``p % S``. Keys are stored after RoPE at their absolute positions, so a cached key never changes.
Heads of a layer with the same slot count share one ``[B, heads, S, D]`` tensor (one attention call per group).

Under grouped-query attention the cache holds key/value heads: each keeps ``S = min(W, max_len)`` slots for the
widest window ``W`` of the query heads that read it (``window_math.kv_group_windows``), and a query head whose own
window is narrower reads only the slots of its newest ``W`` positions (a mask on the slots' age).

With an attention sink (``GPT.sink``, ``model.aah.sink``) a head also keeps the first ``sink`` positions, never evicted:
``min(sink, max_len - S)`` fixed slots before its ring (a position the ring still holds is read there; once the ring
has moved past it, from its fixed slot), so a head keeps ``sink + W`` positions (at most ``max_len``).

Both run the model's own forward (``GPT.forward``) with plans of this module in place of the training ones (the plan
contract: model/attention/registry.py); the block is written once.

* **Prefill** runs the prompts, right-padded to a common length, with ``Prefill`` plans: each calls the layer's
  training plan (the training backends) and, first, copies the layer's keys and values after RoPE into the ring
  buffers, per row: slot ``s`` receives the newest position ``p < len`` with ``p % S == s`` (two slice copies). Causal
  attention never lets a real token see the padding after it, so every row's logits are exact.
* **Decode** feeds one token per row at that row's own absolute position (``GPT.forward(positions=...)``; rows may
  have prompts of different lengths) with ``Decode`` plans: each writes the step's key and value into the layer's
  rings and attends each head over its own slots only. Slot ``s`` is filled once the row has reached position
  ``s``; every filled slot lies within the head's window because ``S <= W``.

Both plans are ``eager``: under ``model.gpt.compile_blocks`` the blocks run uncompiled for generation, as the cache's
Python state changes at every call.

Past the trained ``seq_len`` nothing changes: windowed heads keep sliding, and full-window heads (``W = seq_len``)
slide too, at ``seq_len`` - exactly what one forward pass over the whole text computes with the same window table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from aah_lightning.errors import require
from aah_lightning.model.gpt import GPT
from aah_lightning.model.window_math import kv_group_windows

# The prefill length is rounded up to a multiple of this, so that batches of similar prompts reuse one attention plan
# (and, on a GPU, one compiled FlexAttention kernel).
PREFILL_MULTIPLE = 64


@dataclass
class GenerationConfig:
    """How to continue a prompt.

    Args:
        max_new_tokens: tokens to generate per prompt (fewer when it ends its document first).
        temperature: softmax temperature; 0 = greedy (the most likely token, no randomness).
        top_k: sample among the k most likely tokens only; 0 = no limit.
        top_p: nucleus sampling: the smallest set of most likely tokens whose probability reaches top_p; 1 = all.
        seed: sampling seed; prompt ``i`` draws from its own generator seeded by ``(seed, i)``, so a prompt's
            completion does not depend on the batch or rank it lands on.
        stop_at_eod: stop a prompt's generation at the end-of-document token (not part of the completion).
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_at_eod: bool = True

    def validate(self, name=lambda field: f"generate.{field}") -> None:
        """Raise ``ConfigError`` for a bad setting; ``name`` spells a field as the user wrote it."""
        n = self.max_new_tokens
        require(isinstance(n, int) and n > 0, name("max_new_tokens"), n, "a positive integer")
        require(self.temperature >= 0, name("temperature"), self.temperature, ">= 0 (0 = greedy)")
        require(isinstance(self.top_k, int) and self.top_k >= 0, name("top_k"), self.top_k, ">= 0 (0 = off)")
        require(0 < self.top_p <= 1, name("top_p"), self.top_p, "in (0, 1] (1 = off)")
        require(isinstance(self.seed, int), name("seed"), self.seed, "an integer")


# -- the cache ---------------------------------------------------------------------------------------------------------
@dataclass
class _Group:
    """Key/value heads of one layer that share a slot count: their ring buffers ``k``, ``v`` ``[B, heads, S, D]``,
    and the query heads that read them (in key/value head order, so that query ``i`` reads key/value head
    ``i // (queries / heads)`` of the group) with their windows."""

    heads: Tensor | None  # the layer's key/value heads in this group; None = all of them, in order
    queries: Tensor | None  # the query heads that read them; None = all of them, in order
    windows: Tensor  # [queries] the query heads' windows
    narrowest: int  # the smallest of them: below ``slots``, some query head reads only part of the ring
    slots: int  # the ring's slots
    sink: int = 0  # fixed slots before the ring: positions 0 .. sink - 1
    k: Tensor | None = None  # [B, heads, sink + slots, D]
    v: Tensor | None = None


def sink_slots(slots: int, max_len: int, sink: int) -> int:
    """Fixed slots of the first positions beside a ring of ``slots``: those the ring moves past before ``max_len``."""
    return min(sink, max(0, max_len - slots))


def slot_counts(windows, max_len: int, n_kv_head: int | None = None, sink: int = 0) -> list[list[int]]:
    """Slots per layer and key/value head: ``min(W, max_len)`` in the ring, with ``W`` the widest window of the query
    heads that read the key/value head (``n_kv_head`` None: one per query head, its own window), plus the attention
    sink's fixed slots: ``min(sink + W, max_len)`` in all."""
    if n_kv_head is not None:
        windows = kv_group_windows(windows, n_kv_head).tolist()
    rings = [[min(int(w), max_len) for w in row] for row in windows]
    return [[s + sink_slots(s, max_len, sink) for s in row] for row in rings]


def cache_bytes(
    windows,
    max_len: int,
    head_dim: int,
    batch: int = 1,
    dtype=torch.float32,
    n_kv_head: int | None = None,
    sink: int = 0,
) -> int:
    """Bytes of the window cache: sum over layers and key/value heads of ``min(sink + W, T)`` x D x 2 (keys, values)
    x dtype size (``W``: the widest window of the key/value head's query heads)."""
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(map(sum, slot_counts(windows, max_len, n_kv_head, sink))) * head_dim * 2 * size * batch


def full_cache_bytes(
    n_layer: int, n_head: int, max_len: int, head_dim: int, batch: int = 1, dtype=torch.float32
) -> int:
    """Bytes of a cache that keeps every position for every key/value head (``n_head``: the model's key/value heads,
    ``n_kv_head``): what a model without windows needs."""
    return n_layer * n_head * max_len * head_dim * 2 * torch.empty(0, dtype=dtype).element_size() * batch


class WindowKVCache:
    """Per layer, ring buffers of keys and values (after RoPE) for each group of key/value heads with the same slot
    count."""

    def __init__(self, model: GPT, batch: int, max_len: int):
        self.max_len, self.sink = max_len, model.sink
        rows = model.planner.rows(model.windows)
        n_head, n_kv = model.cfg.n_head, model.cfg.kv_heads
        self.slots = slot_counts(rows, max_len, n_kv)  # the rings; the sink's fixed slots come on top
        device = model.windows.device
        per_kv = n_head // n_kv
        self.layers: list[list[_Group]] = []
        for row, slots in zip(rows, self.slots):
            groups = []
            for s in sorted(set(slots)):
                heads = [j for j, x in enumerate(slots) if x == s]
                queries = [h for j in heads for h in range(j * per_kv, (j + 1) * per_kv)]
                whole = len(heads) == len(slots)
                windows = torch.tensor([row[h] for h in queries], device=device).view(1, -1, 1, 1)
                groups.append(
                    _Group(
                        None if whole else torch.tensor(heads, device=device),
                        None if whole else torch.tensor(queries, device=device),
                        windows,
                        min(row[h] for h in queries),
                        s,
                        sink_slots(s, max_len, model.sink),
                    )
                )
            self.layers.append(groups)
        self.positions = torch.zeros(batch, dtype=torch.long, device=device)  # next position, per row
        self.min_position = 0  # host copy of positions.min(): decides whether every slot is filled
        self.plans = [Decode(self, layer) for layer in range(len(self.layers))]  # a decode step's, one per layer

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for groups in self.layers for g in groups for x in (g.k, g.v) if x is not None)

    def fill(self, layer: int, k: Tensor, v: Tensor, lengths: list[int]) -> None:
        """Store a prefill's keys and values ``[B, Hkv, L, D]`` (row ``b`` valid up to ``lengths[b]``) in the rings.

        Row ``b`` keeps its last ``min(S, n)`` positions: position ``p`` goes to slot ``p % S``, so the newest ``S``
        positions ``[n - S, n)`` are two plain copies, split where the slot index wraps around. Slots a short row has
        not reached are zeros (finite: a masked slot must not turn the attention into NaN) until decoding writes them.
        """
        B, _, _, D = k.shape
        for g in self.layers[layer]:
            heads = slice(None) if g.heads is None else g.heads
            shape = (B, k.shape[1] if g.heads is None else len(g.heads), g.sink + g.slots, D)
            g.k, g.v = k.new_zeros(shape), v.new_zeros(shape)
            for b, n in enumerate(lengths):
                for cache, x in ((g.k, k), (g.v, v)):
                    first = min(g.sink, n)  # the sink's fixed slots: positions 0 .. sink - 1
                    cache[b, :, :first] = x[b, heads, :first]
                    ring = cache[:, :, g.sink :]
                    if n <= g.slots:
                        ring[b, :, :n] = x[b, heads, :n]
                        ring[b, :, n:] = 0
                    else:
                        r = n % g.slots  # the slot of position n - S
                        ring[b, :, r:] = x[b, heads, n - g.slots : n - r]
                        ring[b, :, :r] = x[b, heads, n - r : n]

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Write this step's keys and values ``[B, Hkv, 1, D]`` at each row's position, then attend each query head
        ``[B, H, 1, D]`` over its key/value head's slots within its own window: ``[B, H, 1, D]``."""
        B = q.shape[0]
        rows = torch.arange(B, device=q.device)
        groups = self.layers[layer]
        out = None if len(groups) == 1 else torch.empty_like(q)
        for g in groups:
            kg, vg = (x if g.heads is None else x.index_select(1, g.heads) for x in (k, v))
            qg = q if g.queries is None else q.index_select(1, g.queries)
            slot = g.sink + torch.remainder(self.positions, g.slots)
            g.k[rows, :, slot] = kg[:, :, 0]
            g.v[rows, :, slot] = vg[:, :, 0]
            if self.min_position < g.sink:  # a row still at a sink position (a short prompt): its fixed slot too
                first = (self.positions < g.sink).nonzero().flatten()
                g.k[first, :, self.positions[first]] = kg[first, :, 0]
                g.v[first, :, self.positions[first]] = vg[first, :, 0]
            mask = None
            # Some row has not filled every slot yet, some query head sees fewer positions than the ring holds, or
            # the model has a sink (the ring shows sink positions to every head; fixed slots once the ring passed).
            if self.min_position < g.slots - 1 or g.narrowest < g.slots or self.sink:
                position = self.positions.view(B, 1, 1, 1)
                age = torch.remainder(position - torch.arange(g.slots, device=q.device), g.slots)  # [B, 1, 1, S]
                # reached, and within the query head's window or (a sink position still in the ring) a sink
                mask = (age <= position) & ((age < g.windows) | (position - age < self.sink))
                if g.sink:
                    fixed = position - torch.arange(g.sink, device=q.device) >= g.slots  # the ring moved past it
                    mask = torch.cat([fixed.expand(B, 1, 1, g.sink).expand(-1, mask.shape[1], -1, -1), mask], -1)
            y = F.scaled_dot_product_attention(qg, g.k, g.v, attn_mask=mask, enable_gqa=qg.shape[1] != g.k.shape[1])
            if out is None:
                return y
            out.index_copy_(1, g.queries, y)
        return out

    def advance(self) -> None:
        self.positions += 1
        self.min_position += 1


class Prefill:
    """Prefill's plan for one layer: store the prompts' keys and values in the cache, then run the layer's training
    plan ``inner``."""

    eager = True
    head_groups = None  # the cache stores every head in its own order

    def __init__(self, cache: WindowKVCache, layer: int, inner, lengths: list[int]):
        self.cache, self.layer, self.inner, self.lengths = cache, layer, inner, lengths

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.cache.fill(self.layer, k, v, self.lengths)
        return self.inner(q, k, v)


class Decode:
    """A decode step's plan for one layer: write the step's keys and values, attend over the cache."""

    eager = True
    head_groups = None

    def __init__(self, cache: WindowKVCache, layer: int):
        self.cache, self.layer = cache, layer

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self.cache.attend(self.layer, q, k, v)


# -- prefill and decode ------------------------------------------------------------------------------------------------
@torch.no_grad()
def prefill(model: GPT, prompts: list, max_new_tokens: int) -> tuple[WindowKVCache, Tensor]:
    """Run the prompts (lists of token ids, each non-empty) through the model's forward, filling a new cache.
    Returns the cache and each row's logits after its last prompt token ``[B, vocab]``."""
    lengths_list = [len(p) for p in prompts]
    if min(lengths_list, default=0) < 1:
        raise ValueError("every prompt needs at least one token")
    device = model.windows.device
    B, longest = len(prompts), max(lengths_list)
    padded = -(-longest // PREFILL_MULTIPLE) * PREFILL_MULTIPLE
    tokens = torch.zeros(B, padded, dtype=torch.long)
    for b, p in enumerate(prompts):
        tokens[b, : len(p)] = torch.as_tensor(np.asarray(p, dtype=np.int64))
    tokens = tokens.to(device)
    lengths = torch.tensor(lengths_list, device=device)
    cache = WindowKVCache(model, B, longest + max_new_tokens)
    plans = [Prefill(cache, layer, plan, lengths_list) for layer, plan in enumerate(model.attention_plans(padded))]
    logits = model(tokens, at=lengths - 1, plans=plans)
    cache.positions = lengths.clone()
    cache.min_position = min(lengths_list)
    return cache, logits


@torch.no_grad()
def decode_step(model: GPT, cache: WindowKVCache, tokens: Tensor) -> Tensor:
    """Feed one token per row (``[B]``) at each row's next position; returns the logits after it ``[B, vocab]``."""
    logits = model(tokens.view(-1, 1), positions=cache.positions.view(-1, 1), plans=cache.plans)
    cache.advance()
    return logits[:, 0]


# -- sampling ----------------------------------------------------------------------------------------------------------
def row_generator(seed: int, index: int, device) -> torch.Generator:
    """The sampling generator of prompt ``index``: independent streams for every (seed, prompt) pair."""
    state = int(np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint64)[0])
    return torch.Generator(device=device).manual_seed(state)


def sample(logits: Tensor, cfg: GenerationConfig, generators: list[torch.Generator] | None) -> Tensor:
    """Next token per row ``[B]`` from logits ``[B, vocab]``: greedy at temperature 0, else temperature, top-k and
    top-p (nucleus) sampling, row ``b`` drawing from ``generators[b]``."""
    if cfg.temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / cfg.temperature
    if cfg.top_k:
        kth = logits.topk(min(cfg.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens: the first token is always kept
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(before >= cfg.top_p, 0.0))
    return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generators)])


@dataclass
class Completion:
    tokens: list[int]  # the generated tokens, without the end-of-document token
    stop: str  # "eod": the model ended the document; "length": max_new_tokens reached


@torch.no_grad()
def generate(
    model: GPT, prompts: list, cfg: GenerationConfig, eod_id: int | None = None, indices: list[int] | None = None
) -> list[Completion]:
    """Continue each prompt (a list of token ids). ``indices``: the prompts' numbers, which seed their sampling
    (default 0, 1, ...). Rows that stop early ride along until every row has stopped."""
    cache, logits = prefill(model, prompts, cfg.max_new_tokens)
    indices = list(range(len(prompts))) if indices is None else indices
    generators = None
    if cfg.temperature > 0:
        generators = [row_generator(cfg.seed, i, logits.device) for i in indices]
    out: list[list[int]] = [[] for _ in prompts]
    stop = ["length"] * len(prompts)
    for step in range(cfg.max_new_tokens):
        nxt = sample(logits, cfg, generators)
        for b, t in enumerate(nxt.tolist()):
            if stop[b] == "eod":
                continue
            if cfg.stop_at_eod and t == eod_id:
                stop[b] = "eod"
            else:
                out[b].append(t)
        if step == cfg.max_new_tokens - 1 or all(s == "eod" for s in stop):
            break
        logits = decode_step(model, cache, nxt)
    return [Completion(o, s) for o, s in zip(out, stop)]
