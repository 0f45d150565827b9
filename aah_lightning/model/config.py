"""Shape and execution settings of the GPT."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from aah_lightning.errors import ConfigError, require
from aah_lightning.model.attention import backend_names

# Every registered attention backend, as a type: ``--help`` lists the choices and the parser refuses others.
Backend = Literal[backend_names()]


@dataclass(frozen=True)
class GPTConfig:
    """The GPT's shape and how it runs: the settings ``model.gpt.*`` (this docstring is their ``--help``).

    Attributes:
        vocab_size: vocabulary size (linked from the data module's tokenizer).
        seq_len: training sequence length T (linked from data.seq_len).
        n_layer: transformer blocks.
        n_head: attention heads per block (each has its own window).
        n_embd: model width (n_embd / n_head must be even for RoPE).
        mlp_ratio: MLP hidden width / n_embd.
        bias: biases in linear layers and norms.
        rope_base: RoPE frequency base.
        backend: attention backend: auto (flex on CUDA; banded or dense-mask SDPA on CPU) or a registered one
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
    mlp_ratio: float = 4.0
    bias: bool = False
    rope_base: float = 10000.0
    # Attention execution (same semantics everywhere; see model/attention/).
    backend: Backend = "auto"
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
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"model.gpt.n_embd={self.n_embd} is not divisible by model.gpt.n_head={self.n_head}: "
                f"each head needs n_embd / n_head channels (try n_embd={self.n_head * max(1, self.n_embd // self.n_head)})"
            )
        head_dim = self.n_embd // self.n_head
        if head_dim % 2:
            raise ConfigError(
                f"head size n_embd/n_head={head_dim} is odd: RoPE rotates channel pairs, so the head size must be even "
                f"(model.gpt.n_embd={self.n_embd}, model.gpt.n_head={self.n_head})"
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
        return self.n_embd // self.n_head


# The settings that decide the shapes of the GPT's weights (and of its window table [n_layer, n_head]): a checkpoint
# loads only into a GPT of the same ones (checkpoint.check_matches names the one that differs).
WEIGHT_SHAPE_SETTINGS = ("n_layer", "n_head", "n_embd", "vocab_size", "mlp_ratio", "bias")
