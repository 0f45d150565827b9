"""Shape and execution settings of the GPT."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Literal

from aah_lightning.errors import ConfigError, require
from aah_lightning.model.attention import backend_names

# Every registered attention backend, as a type: ``--help`` lists the choices and the parser refuses others.
Backend = Literal[backend_names()]


@dataclass
class GPTConfig:
    """The GPT's shape and how its attention runs.

    Attributes:
        vocab_size: vocabulary size (linked from the data module's tokenizer).
        seq_len: training sequence length T (linked from data.seq_len).
        n_layer: transformer blocks.
        n_head: attention heads per block (each has its own window).
        n_embd: model width (n_embd / n_head must be even for RoPE).
        mlp_ratio: MLP hidden width / n_embd.
        bias: biases in linear layers and norms.
        rope_base: RoPE frequency base.
        backend: attention backend: auto (flex on CUDA; banded or dense-mask SDPA on CPU) or a registered backend.
        block_size: FlexAttention BlockMask tile size.
        document_mask: queries attend only within their own document.
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
    block_size: int = 128  # BlockMask tile size for flex
    document_mask: bool = False  # queries see only keys of their own document

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd", "block_size"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, f"model.{name}", value, "a positive integer")
        if self.n_embd % self.n_head:
            raise ConfigError(
                f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}: "
                f"each head needs n_embd / n_head channels (try n_embd={self.n_head * max(1, self.n_embd // self.n_head)})"
            )
        head_dim = self.n_embd // self.n_head
        if head_dim % 2:
            raise ConfigError(
                f"head size n_embd/n_head={head_dim} is odd: RoPE rotates channel pairs, so the head size must be even "
                f"(model.n_embd={self.n_embd}, model.n_head={self.n_head})"
            )
        require(self.backend in backend_names(), "model.backend", self.backend, f"one of {', '.join(backend_names())}")
        require(self.mlp_ratio > 0, "model.mlp_ratio", self.mlp_ratio, "a positive number")

    @classmethod
    def from_settings(cls, settings: Mapping) -> GPTConfig:
        """The GPT's settings among ``settings`` (e.g. the LightningModule's flat ``model.*`` hyperparameters)."""
        return cls(**{f.name: settings[f.name] for f in fields(cls) if f.name in settings})

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head
