"""A GPT decoder whose heads each attend within their own causal window. Pure PyTorch, read top to bottom.

Pre-norm blocks, rotary position embeddings, tied input/output embeddings, GPT-2 initialisation (std 0.02, residual
projections scaled by 1/sqrt(2 * n_layer)), no dropout anywhere (FlexAttention has none; LM pre-training rarely
wants it). The Llama family's choices are settings of ``GPTConfig`` whose defaults are the GPT above: grouped-query
attention (``n_kv_head``), SwiGLU, RMSNorm, an untied output layer, q/k norm (Qwen3), q/k/v biases (Qwen2) and RoPE
scaling (linear, llama3).

The window table ``windows: int32[n_layer, n_head]`` is a persistent buffer, so every state_dict and checkpoint
carries it. ``sink`` (``model.aah.sink``, given by whoever builds the GPT: the training module from its settings,
``checkpoint.build_model`` from a checkpoint's) keeps the first positions visible to every windowed head. Policies and the AAH controller write it in place (``set_windows``); attention plans follow on the next
forward (model/attention/) and nothing recompiles.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from aah_lightning.model.attention import AttentionPlanner, LayerPlan, resolve_backend
from aah_lightning.model.config import GPTConfig


def rope_frequencies(cfg: GPTConfig) -> Tensor:
    """RoPE's inverse frequencies ``[head_dim / 2]`` (float32): ``base ** (-2i / D)``, then ``cfg.rope_scaling``.

    * linear: every frequency divided by ``rope_factor`` (positions interpolated);
    * llama3 (Llama 3.1): wavelengths ``2 pi / f`` longer than ``original / low_freq_factor`` are divided by
      ``rope_factor``, those shorter than ``original / high_freq_factor`` are kept, and those between blend the two
      with a weight linear in ``original / wavelength``.
    """
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = cfg.rope_factor
    if cfg.rope_scaling == "linear":
        return inv_freq / factor
    if cfg.rope_scaling == "llama3":
        original, low, high = cfg.rope_original_seq_len, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelength = 2 * math.pi / inv_freq
        kept = original / wavelength  # periods of the original context per wavelength
        smooth = ((kept - low) / (high - low)).clamp(0, 1)  # 0: long waves (scaled), 1: short waves (kept)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return inv_freq


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half form) for head size ``dim``; ``inv_freq``: the frequencies (default:
    unscaled, ``base ** (-2i / dim)``)."""

    def __init__(self, dim: int, base: float, inv_freq: Tensor | None = None):
        super().__init__()
        if inv_freq is None:
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cache: tuple | None = None

    def forward(self, seq_len: int, device, dtype) -> tuple[Tensor, Tensor]:
        key = (seq_len, device, dtype)
        if self._cache is None or self._cache[0] != key:
            t = torch.arange(seq_len, device=device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq.to(device))
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cache = (key, emb.cos().to(dtype), emb.sin().to(dtype))
        return self._cache[1], self._cache[2]

    def at(self, positions: Tensor, dtype) -> tuple[Tensor, Tensor]:
        """cos, sin at ``positions`` (``[B, T]``, each row its own): ``[B, 1, T, dim]``, the values of the table
        ``forward`` builds at those positions (the same products, cos and sin, computed the same way)."""
        freqs = positions.unsqueeze(-1) * self.inv_freq  # integer positions: exact in float32 below 2**24
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: ``[B, H, T, D]``; cos/sin: ``[T, D]`` (every row at positions 0..T-1) or ``[B, 1, T, D]`` (per row)."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def make_norm(cfg: GPTConfig, dim: int) -> nn.Module:
    """The norm of ``cfg.norm`` over ``dim`` channels (LayerNorm has a bias only with ``cfg.bias``)."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


class CausalSelfAttention(nn.Module):
    """Attention with ``n_head`` query heads and ``n_kv_head`` key/value heads (grouped-query attention: query head
    ``h`` reads key/value head ``h // (n_head / n_kv_head)``). One fused projection holds the rows of q (``n_head``
    heads), then k and v (``n_kv_head`` heads each)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        q_size, kv_size = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.qkv = nn.Linear(cfg.n_embd, q_size + 2 * kv_size, bias=cfg.bias or cfg.qkv_bias)
        self.proj = nn.Linear(q_size, cfg.n_embd, bias=cfg.bias)
        self.proj.residual_scaled = True
        if cfg.qk_norm:  # one norm over each head's channels, shared by the heads (Qwen3)
            self.q_norm, self.k_norm = make_norm(cfg, cfg.head_dim), make_norm(cfg, cfg.head_dim)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, plan: LayerPlan) -> Tensor:
        B, T, _ = x.shape
        groups = plan.head_groups
        q_order = kv_order = None
        if groups is not None:
            q_order = groups.order
            # The groups' plans take one key/value head per query head (a group's query heads need not share their
            # key/value heads): under GQA the projection computes each query head's key/value head (repeated rows).
            kv_order = q_order if self.n_kv_head == self.n_head else self._kv_heads_of(q_order, x.device)
        q, k, v = self._qkv(x, q_order, kv_order)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # under autocast q is bf16; keep it so
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        # v is a strided view into the qkv output; inside a compiled block, CPU flex reads such a view wrongly
        # (pytorch#157612, q/k/v of one buffer). One copy per layer is cheap against attention.
        v = v.contiguous()
        if groups is None:
            y = plan(q, k, v)
            return self.proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))
        return self._grouped(q, k, v, groups)

    def _kv_heads_of(self, order: Tensor | None, device) -> Tensor:
        """The key/value head of each query head of ``order`` (None: the layer's order)."""
        heads = torch.arange(self.n_head, device=device) if order is None else order
        return heads // (self.n_head // self.n_kv_head)

    def _head_index(self, order: Tensor) -> Tensor:
        """The feature indices ``h * D .. h * D + D - 1`` of the heads in ``order``, head after head."""
        D = self.head_dim
        return (order.view(-1, 1) * D + torch.arange(D, device=order.device)).flatten()

    def _qkv(self, x: Tensor, q_order: Tensor | None, kv_order: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v ``[B, heads, T, D]``; with ``q_order`` / ``kv_order`` the heads come in that order (query heads
        of ``q_order``, key/value heads of ``kv_order``): the projection's weight rows are reordered, not its output
        (B x T x rows)."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        if q_order is None and kv_order is None:
            out, n_kv = self.qkv(x), Hkv
        else:
            device = self.qkv.weight.device
            q_rows = torch.arange(H * D, device=device) if q_order is None else self._head_index(q_order)
            kv_rows = torch.arange(Hkv * D, device=device) if kv_order is None else self._head_index(kv_order)
            n_kv = kv_rows.numel() // D
            rows = torch.cat([q_rows, kv_rows + H * D, kv_rows + (H + Hkv) * D])
            bias = None if self.qkv.bias is None else self.qkv.bias.index_select(0, rows)
            out = F.linear(x, self.qkv.weight.index_select(0, rows), bias)
        q, k, v = out.split([H * D, n_kv * D, n_kv * D], dim=-1)
        return tuple(t.view(B, T, -1, D).transpose(1, 2) for t in (q, k, v))

    def _grouped(self, q: Tensor, k: Tensor, v: Tensor, groups) -> Tensor:
        """Heads in groups (q, k, v ``[B, H, T, D]`` already in the groups' order): each group's plan runs on its slice
        of heads (a view), and the output projection adds the groups' outputs up through the matching columns of its
        weight, so no activation is gathered, concatenated or scattered back."""
        B, H, T, D = q.shape
        weight = (
            self.proj.weight
            if groups.order is None
            else self.proj.weight.index_select(1, self._head_index(groups.order))
        )
        out, start = None, 0
        for size, part in zip(groups.sizes, groups.parts):
            heads = slice(start, start + size)
            y = part(q[:, heads], k[:, heads], v[:, heads]).transpose(1, 2).reshape(B * T, size * D)
            w = weight[:, start * D : (start + size) * D].t()
            if out is None:
                out = y @ w if self.proj.bias is None else torch.addmm(self.proj.bias, y, w)
            else:
                out = torch.addmm(out, y, w)
            start += size
        return out.view(B, T, -1)


class MLP(nn.Module):
    """GELU MLP: ``proj(gelu(fc x))``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, cfg.mlp_width, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_width, cfg.n_embd, bias=cfg.bias)
        self.proj.residual_scaled = True

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


class SwiGLU(nn.Module):
    """Gated MLP of the Llama family: ``proj(silu(gate x) * up x)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.gate = nn.Linear(cfg.n_embd, cfg.mlp_width, bias=cfg.bias)
        self.up = nn.Linear(cfg.n_embd, cfg.mlp_width, bias=cfg.bias)
        self.proj = nn.Linear(cfg.mlp_width, cfg.n_embd, bias=cfg.bias)
        self.proj.residual_scaled = True

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = make_norm(cfg, cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = make_norm(cfg, cfg.n_embd)
        self.mlp = SwiGLU(cfg) if cfg.mlp == "swiglu" else MLP(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, plan: LayerPlan) -> Tensor:
        x = x + self.attn(self.ln1(x), cos, sin, plan)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, sink: int = 0):
        super().__init__()
        self.cfg = cfg
        # The attention sink: not a buffer, so the one copy of the value is model.aah.sink in the run's settings and
        # in every checkpoint's hyperparameters (docs/architecture.md, "Attention sinks").
        self.sink = int(sink)
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = make_norm(cfg, cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.rotary = Rotary(cfg.head_dim, cfg.rope_base, rope_frequencies(cfg))
        # The window table: every head starts with the full causal context.
        self.register_buffer("windows", torch.full((cfg.n_layer, cfg.n_head), cfg.seq_len, dtype=torch.int32))
        self.planner = AttentionPlanner(cfg.block_size)
        # While a learned span trains (windows/span.py): a callable (plans, doc_ids) -> plans that wraps each layer's
        # plan of the hard windows in its ramped attention. None: the window table's plans, as they are.
        self.soft_plans = None
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if getattr(module, "residual_scaled", False) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @torch.no_grad()
    def set_windows(self, table) -> None:
        """Write the window table in place (int ``[n_layer, n_head]``); masks follow on the next forward."""
        table = torch.as_tensor(table, dtype=torch.int32)
        if table.shape != self.windows.shape:
            raise ValueError(
                f"window table shape {tuple(table.shape)} != (n_layer, n_head) {tuple(self.windows.shape)}"
            )
        self.windows.copy_(table.to(self.windows.device))

    def attention_plans(self, seq_len: int, doc_ids: Tensor | None = None, backend: str | None = None):
        """The per-layer plans the next forward will use (also what diagnostics measure)."""
        needs_grad = torch.is_grad_enabled()
        name = resolve_backend(backend or self.cfg.backend, self.windows.device, needs_grad, seq_len)
        docs = doc_ids if self.cfg.document_mask else None
        plans = self.planner.plans(self.windows, seq_len, name, docs, self.sink)
        return plans if self.soft_plans is None else self.soft_plans(plans, docs)

    def forward(
        self,
        idx: Tensor,
        doc_ids: Tensor | None = None,
        backend: str | None = None,
        at: Tensor | None = None,
        plans: list[LayerPlan] | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """idx: ``[B, T]`` token ids -> logits ``[B, T, vocab]``. The one forward of the model: training, evaluation,
        the probe, and generation's prefill and decode steps all run it.

        ``doc_ids`` (``[B, T]``) only matter with ``document_mask``. ``at`` (``[B]`` positions): only the logits
        there, ``[B, vocab]`` (generation's prefill needs one position per row, and the output layer is the costliest
        matmul of a large vocabulary). ``plans``: one attention plan per layer (the contract: model/attention/
        registry.py, ``Plan``), by default ``attention_plans(T, doc_ids, backend)``; the probe passes plans that
        record q, k, v, generation plans that fill and read its window KV cache. ``positions`` (``[B, T]``): each
        token's absolute position, for RoPE (decode steps: each row at its own next position); default ``0..T-1``.
        """
        T = idx.shape[1]
        if plans is None:
            plans = self.attention_plans(T, doc_ids, backend)
        x = self.wte(idx)
        if positions is None:
            cos, sin = self.rotary(T, x.device, torch.float32)
        else:
            cos, sin = self.rotary.at(positions, torch.float32)
        for block, plan in zip(self.blocks, plans):
            if plan.eager:
                # Never a compiled graph, but through the module's call: hooks on the block still run (FSDP2's gathers
                # a sharded block's weights; calling its class's forward directly would skip it).
                with torch.compiler.set_stance("force_eager"):
                    x = block(x, cos, sin, plan)
            else:
                x = block(x, cos, sin, plan)
        if at is not None:
            x = x[torch.arange(x.shape[0], device=x.device), at]
        return self.lm_head(self.ln_f(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
