"""Shape and execution settings of the GPT."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from aah_lightning.errors import ConfigError, require
from aah_lightning.model.attention import backend_names

# Every registered attention backend, as a type: ``--help`` lists the choices and the parser refuses others.
BackendName = Literal[backend_names()]


@dataclass(frozen=True)
class GPTConfig:
    """The GPT's shape and how it runs: the settings ``model.gpt.*`` (this docstring is their ``--help``).

    Attributes:
        vocab_size: vocabulary size (linked from the data module's tokenizer).
        seq_len: training sequence length T (linked from data.seq_len).
        n_layer: transformer blocks.
        n_head: attention heads per block (each has its own window).
        n_embd: model width (n_embd / n_head must be even for RoPE).
        n_kv_head: key/value heads per block (grouped-query attention: query head h reads key/value head
            h // (n_head / n_kv_head); 1 is multi-query attention); None: n_head, one per query head.
        head_size: channels per head; None: n_embd / n_head (Qwen3 sets it apart from the width).
        mlp: the MLP: gelu (fc, GELU, proj) or swiglu (proj(silu(gate x) * up x), Llama's).
        mlp_ratio: MLP hidden width / n_embd (when mlp_hidden is None).
        mlp_hidden: MLP hidden width; None: mlp_ratio * n_embd.
        norm: the norms: layernorm or rmsnorm.
        norm_eps: the norms' epsilon.
        bias: biases in linear layers and norms.
        qkv_bias: biases on the q, k, v projections even without bias (Qwen2: on q, k, v, not on the output).
        qk_norm: a norm (of the kind norm) on each head's q and k, before RoPE (Qwen3).
        tie_embeddings: the output layer shares the token embedding's weights; false: a weight of its own.
        rope_base: RoPE frequency base.
        rope_scaling: RoPE's frequencies for a longer context: none, linear (every frequency / rope_factor) or
            llama3 (Llama 3.1's: low frequencies / rope_factor, high ones kept, a smooth blend between, set by
            rope_low_freq_factor, rope_high_freq_factor and rope_original_seq_len).
        rope_factor: the scaling factor of rope_scaling.
        rope_low_freq_factor: llama3: wavelengths above rope_original_seq_len / this are divided by rope_factor.
        rope_high_freq_factor: llama3: wavelengths below rope_original_seq_len / this are kept.
        rope_original_seq_len: llama3: the context the model was first trained at.
        backend: attention backend: auto (flex_tuned on CUDA; banded for T >= 256, else SDPA, on CPU) or a registered one
            (flex, flex_tuned, flex_fa4, fa4_window, split, varlen, banded, sdpa; docs/architecture.md).
        block_size: FlexAttention BlockMask tile size.
        document_mask: queries attend only within their own document.
        compile_blocks: torch.compile each transformer block (flex attention is always compiled). For GPUs.
        activation_checkpointing: recompute each block's activations in the backward pass (less memory).
        full_heads_beyond_trained: a checkpoint run at a longer sequence than it was trained on: heads whose window
            was the whole trained context see the whole new context (whole_context) or keep the trained length as a
            sliding window (trained_span: no head sees a distance it never saw in training).
    """

    vocab_size: int = 257
    seq_len: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    n_kv_head: int | None = None
    head_size: int | None = None
    mlp: Literal["gelu", "swiglu"] = "gelu"
    mlp_ratio: float = 4.0
    mlp_hidden: int | None = None
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = True
    rope_base: float = 10000.0
    rope_scaling: Literal["none", "linear", "llama3"] = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_seq_len: int = 8192
    # Attention execution (same semantics everywhere; see model/attention/).
    backend: BackendName = "auto"
    block_size: int = 128
    document_mask: bool = False
    # How the Lightning module runs the GPT (lit/distributed.prepare_model, lit/evaluation.widen_full_windows).
    compile_blocks: bool = False
    activation_checkpointing: bool = False
    full_heads_beyond_trained: Literal["whole_context", "trained_span"] = "whole_context"

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd", "block_size"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"model.gpt.{name}", value, "a positive integer")
        for name in ("n_kv_head", "head_size", "mlp_hidden"):
            value = getattr(self, name)
            require(
                value is None or (isinstance(value, int) and value > 0),
                f"model.gpt.{name}",
                value,
                "a positive integer or null",
            )
        if self.n_head % self.kv_heads:
            raise ConfigError(
                f"model.gpt.n_head={self.n_head} is not divisible by model.gpt.n_kv_head={self.n_kv_head}: every "
                f"key/value head serves the same number of query heads"
            )
        if self.head_size is None and self.n_embd % self.n_head:
            raise ConfigError(
                f"model.gpt.n_embd={self.n_embd} is not divisible by model.gpt.n_head={self.n_head}: each head needs "
                f"n_embd / n_head channels (try n_embd={self.n_head * max(1, self.n_embd // self.n_head)}, or set "
                f"model.gpt.head_size)"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"head size {self.head_dim} is odd: RoPE rotates channel pairs, so the head size must be even "
                f"(model.gpt.n_embd={self.n_embd}, model.gpt.n_head={self.n_head}, "
                f"model.gpt.head_size={self.head_size})"
            )
        require(self.mlp in ("gelu", "swiglu"), "model.gpt.mlp", self.mlp, "gelu or swiglu")
        require(self.norm in ("layernorm", "rmsnorm"), "model.gpt.norm", self.norm, "layernorm or rmsnorm")
        require(self.norm_eps > 0, "model.gpt.norm_eps", self.norm_eps, "a positive number")
        scalings = ("none", "linear", "llama3")
        require(self.rope_scaling in scalings, "model.gpt.rope_scaling", self.rope_scaling, "none, linear or llama3")
        require(self.rope_factor > 0, "model.gpt.rope_factor", self.rope_factor, "a positive number")
        if self.rope_scaling == "llama3":
            require(
                0 < self.rope_low_freq_factor < self.rope_high_freq_factor,
                "model.gpt.rope_low_freq_factor",
                self.rope_low_freq_factor,
                f"positive and below model.gpt.rope_high_freq_factor={self.rope_high_freq_factor}",
            )
            require(
                isinstance(self.rope_original_seq_len, int) and self.rope_original_seq_len > 0,
                "model.gpt.rope_original_seq_len",
                self.rope_original_seq_len,
                "a positive integer",
            )
        names = ", ".join(backend_names())
        require(self.backend in backend_names(), "model.gpt.backend", self.backend, f"one of {names}")
        require(self.mlp_ratio > 0, "model.gpt.mlp_ratio", self.mlp_ratio, "a positive number")
        spans = ("whole_context", "trained_span")
        require(
            self.full_heads_beyond_trained in spans,
            "model.gpt.full_heads_beyond_trained",
            self.full_heads_beyond_trained,
            "whole_context or trained_span",
        )

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads per block (``n_kv_head``, or ``n_head`` when unset)."""
        return self.n_kv_head or self.n_head

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width."""
        return self.mlp_hidden or int(self.mlp_ratio * self.n_embd)


# The settings that decide the shapes of the GPT's weights (and of its window table [n_layer, n_head]): a checkpoint
# loads only into a GPT of the same ones (checkpoint.check_matches names the one that differs).
# The norm's kind, q/k norm and tied output change what the weights mean or which exist, so they count too.
WEIGHT_SHAPE_SETTINGS = (
    "n_layer",
    "n_head",
    "n_embd",
    "vocab_size",
    "mlp_ratio",
    "bias",
    "n_kv_head",
    "head_size",
    "mlp",
    "mlp_hidden",
    "norm",
    "qkv_bias",
    "qk_norm",
    "tie_embeddings",
)
