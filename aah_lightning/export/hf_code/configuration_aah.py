"""Configuration of an aah GPT exported for Hugging Face transformers (copied into every export folder).

Self-contained on purpose: an export folder must load with ``trust_remote_code=True`` on a machine without aah.

Besides the usual shape fields, the config holds the model's **window table**: ``windows[l][h]`` is the causal
window of head ``h`` in layer ``l``. Query ``i`` of that head attends to key ``j`` iff ``0 <= i - j < windows[l][h]``
(``W`` keys including itself, fewer near the start), or ``j < sink``: the attention sink, the first ``sink`` positions,
which every head keeps in view (0, the default and what exports without the field mean, is none).
``max_position_embeddings`` is the sequence length the model was trained at; a head whose window is at least that long
saw its whole context in training.

The defaults are aah's own GPT (LayerNorm, GELU MLP, one key/value head per query head, tied output layer). The
Llama family's choices are settings, as in aah's ``GPTConfig``: ``num_key_value_heads`` (grouped-query attention:
query head ``h`` reads key/value head ``h // (num_attention_heads / num_key_value_heads)``), ``head_dim``, ``mlp``
(``gelu`` or ``swiglu``), ``norm`` (``layernorm`` or ``rmsnorm``, epsilon ``layer_norm_eps``), ``qkv_bias`` (biases on
q, k and v only), ``qk_norm`` (a norm over each head's q and k before the rotation), ``tie_word_embeddings`` and the
RoPE scaling (``rope_scaling_type``: ``none``, ``linear`` or ``llama3``, with ``rope_factor``, ``rope_low_freq_factor``,
``rope_high_freq_factor`` and ``rope_original_max_position_embeddings``). The RoPE names are aah's own: transformers
rewrites configs that carry ``rope_scaling`` or ``rope_theta``.
"""

from __future__ import annotations

from transformers import PretrainedConfig


class AAHTransformersConfig(PretrainedConfig):
    """Shape, window table and special tokens of an aah GPT (pre-norm blocks, rotary positions; the Llama family's
    settings as in the module docstring)."""

    model_type = "aah_gpt"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]

    def __init__(
        self,
        vocab_size: int = 257,
        hidden_size: int = 128,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        intermediate_size: int = 512,
        max_position_embeddings: int = 256,
        rope_base: float = 10000.0,
        layer_norm_eps: float = 1e-5,
        bias: bool = False,
        windows: list[list[int]] | None = None,
        document_mask: bool = False,
        initializer_range: float = 0.02,
        use_cache: bool = True,
        bos_token_id: int | None = 256,
        eos_token_id: int | None = 256,
        pad_token_id: int | None = 256,
        tie_word_embeddings: bool = True,
        num_key_value_heads: int | None = None,
        head_dim: int | None = None,
        mlp: str = "gelu",
        norm: str = "layernorm",
        qkv_bias: bool = False,
        qk_norm: bool = False,
        rope_scaling_type: str = "none",
        rope_factor: float = 1.0,
        rope_low_freq_factor: float = 1.0,
        rope_high_freq_factor: float = 4.0,
        rope_original_max_position_embeddings: int = 8192,
        sink: int = 0,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.rope_base = rope_base
        self.layer_norm_eps = layer_norm_eps
        self.bias = bias
        if head_dim is None and hidden_size % num_attention_heads:
            raise ValueError(
                f"hidden_size={hidden_size} is not divisible by num_attention_heads={num_attention_heads} "
                f"(set head_dim)"
            )
        self.num_key_value_heads = int(num_key_value_heads or num_attention_heads)
        self.head_dim = int(head_dim or hidden_size // num_attention_heads)
        self.mlp = mlp
        self.norm = norm
        self.qkv_bias = qkv_bias
        self.qk_norm = qk_norm
        self.rope_scaling_type = rope_scaling_type
        self.rope_factor = rope_factor
        self.rope_low_freq_factor = rope_low_freq_factor
        self.rope_high_freq_factor = rope_high_freq_factor
        self.rope_original_max_position_embeddings = rope_original_max_position_embeddings
        if windows is None:  # every head sees its whole trained context
            windows = [[max_position_embeddings] * num_attention_heads for _ in range(num_hidden_layers)]
        self.windows = [[int(w) for w in row] for row in windows]
        self.sink = int(sink)
        # Recorded for the model card; the exported model does not mask across documents (see the modeling code).
        self.document_mask = document_mask
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        super().__init__(
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
            tie_word_embeddings=tie_word_embeddings,
            **kwargs,
        )
        self.check()

    def check(self) -> None:
        """Raise ``ValueError`` for a shape or window table the model cannot run."""
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (rotary positions)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        for name, allowed in (
            ("mlp", ("gelu", "swiglu")),
            ("norm", ("layernorm", "rmsnorm")),
            ("rope_scaling_type", ("none", "linear", "llama3")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: one of {', '.join(allowed)}")
        shape = (len(self.windows), *{len(row) for row in self.windows})
        if shape != (self.num_hidden_layers, self.num_attention_heads):
            raise ValueError(
                f"windows has shape {shape}, expected [num_hidden_layers, num_attention_heads] = "
                f"[{self.num_hidden_layers}, {self.num_attention_heads}]"
            )
        if any(w < 1 for row in self.windows for w in row):
            raise ValueError("every window must be at least 1 (a head always sees its own position)")
        if self.sink < 0:
            raise ValueError(f"sink={self.sink} must be at least 0 (the first positions every head keeps; 0 = none)")
