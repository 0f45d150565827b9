"""Window-aware training FLOPs of the GPT, for ``perf/mfu``.

What a perfect kernel computes for one training sequence of length T (forward + backward = 3 x forward):

* matmuls: ``2 * N`` FLOPs per token forward, N = weights of every linear layer (q/k/v, attention output, the MLP's
  matrices, and the LM head, tied to the embedding by default; the embedding lookup itself is no matmul). Biases,
  norms, GELU, RoPE and softmax are elementwise and not counted: this is the usual ``6 * N`` rule.
* attention: ``4 * head_dim`` FLOPs per (query, key) pair forward (``q . k`` and ``p * v``), counted only for the
  causal pairs inside each head's window: ``pairs(W, T) = W(W+1)/2 + (T-W)W`` with ``W = min(W, T)``.

A kernel that visits whole tiles (FlexAttention) or full rows does more work than this; MFU measured this way says
how close the run is to doing only the useful work at the device's peak.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from aah_lightning.model.config import GPTConfig
from aah_lightning.model.window_math import window_pairs


def matmul_weights(cfg: GPTConfig) -> int:
    """Weights that take part in a matmul per token: every ``nn.Linear`` of the GPT (q/k/v with ``n_kv_head``
    key/value heads, three MLP matrices for SwiGLU), the LM head once (tied or not)."""
    c, hidden, q_size = cfg.n_embd, cfg.mlp_width, cfg.n_head * cfg.head_dim
    attention = c * (q_size + 2 * cfg.kv_heads * cfg.head_dim) + q_size * c
    per_layer = attention + (3 if cfg.mlp == "swiglu" else 2) * c * hidden
    return cfg.n_layer * per_layer + cfg.vocab_size * c


def attention_pairs(rows: Iterable[Iterable[int]], seq_len: int, sink: int = 0) -> int:
    """Causal in-window pairs (and the attention sink's) summed over every (layer, head) of a window table given as
    rows of ints."""
    return sum(window_pairs(w, seq_len, sink) for row in rows for w in row)


def forward_flops(cfg: GPTConfig, rows: Iterable[Iterable[int]], seq_len: int, sink: int = 0) -> int:
    """Forward FLOPs of one sequence of ``seq_len`` tokens under the window table ``rows`` and attention sink."""
    return 2 * matmul_weights(cfg) * seq_len + 4 * cfg.head_dim * attention_pairs(rows, seq_len, sink)


def training_flops(cfg: GPTConfig, rows: Iterable[Iterable[int]], seq_len: int, sink: int = 0) -> int:
    """Forward + backward FLOPs of one training sequence (backward = 2 x forward)."""
    return 3 * forward_flops(cfg, rows, seq_len, sink)


# Dense peak FLOP/s of one current NVIDIA datacenter GPU, by matmul type. Sources: NVIDIA's product datasheets,
# "NVIDIA H100 Tensor Core GPU" (SXM, PCIe, NVL), "NVIDIA H200 Tensor Core GPU" (SXM, NVL) and "NVIDIA HGX B200"
# (per GPU). The datasheets print tensor-core figures with 2:4 structured sparsity; dense training runs at half of
# them. "tf32" is float32 matmuls on tensor cores (torch's matmul precision "high" or "medium"), float32 the plain
# FP32 units ("highest"). Keys are fragments of torch.cuda.get_device_name(), lower case; the first one found wins.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "h100 nvl": {"bf16": 835e12, "tf32": 418e12, "fp32": 60e12},
    "h100 pcie": {"bf16": 756e12, "tf32": 378e12, "fp32": 51e12},
    "h100": {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12},  # SXM, named "NVIDIA H100 80GB HBM3"
    "h200 nvl": {"bf16": 835e12, "tf32": 418e12, "fp32": 60e12},
    "h200": {"bf16": 989e12, "tf32": 495e12, "fp32": 67e12},  # SXM, named "NVIDIA H200"
    "b200": {"bf16": 2250e12, "tf32": 1100e12, "fp32": 75e12},
}


def peak_flops(device_name: str, dtype: torch.dtype, float32_matmul_precision: str = "highest") -> float | None:
    """Dense peak FLOP/s of the GPU named ``device_name`` for matmuls in ``dtype`` (fp16 runs at the bf16 rate);
    None if the GPU is not in ``PEAK_FLOPS`` or the dtype has no entry (float64)."""
    name = device_name.lower()
    row = next((peaks for fragment, peaks in PEAK_FLOPS.items() if fragment in name), None)
    if row is None:
        return None
    if dtype in (torch.bfloat16, torch.float16):
        return row["bf16"]
    if dtype is torch.float32:
        return row["fp32"] if float32_matmul_precision == "highest" else row["tf32"]
    return None
