"""An aah GPT for Hugging Face transformers: per-head causal attention windows (copied into every export folder).

Self-contained on purpose (torch and transformers only): the export folder loads with
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` on a machine without aah.

The network is aah's GPT, computed the same way: pre-norm blocks (norm, attention, norm, MLP), rotary position
embeddings in rotate-half form applied to queries and keys, no dropout. By default the norms are LayerNorm, the MLP is
GELU, every query head has its own key/value head and the output layer reuses the token embedding matrix; the Llama
family's choices are config settings (``configuration_aah.py``): grouped-query attention, SwiGLU, RMSNorm, an untied
output layer, q/k/v biases, a norm over each head's q and k (Qwen3) and RoPE's linear or llama3 scaling. Attention runs through ``scaled_dot_product_attention`` with a boolean mask built from the
window table in the config: query ``i`` of head ``h`` in layer ``l`` attends to key ``j`` iff
``0 <= i - j < windows[l][h]`` or ``0 <= j < sink <= i`` (the config's attention sink: the first ``sink`` positions of
the text stay visible), with ``i`` and ``j`` counted over the whole text so far (cached tokens included).
Keys marked 0 in a 2-D ``attention_mask`` (padding) are never attended to. ``attn_implementation`` is ``"sdpa"``
(the default) or ``"eager"`` (the same softmax written out); ``output_attentions=True`` computes the weights the
eager way, ``output_hidden_states=True`` returns the embeddings, every block's input and the final output.

Incremental decoding keeps every past key and value in a transformers ``DynamicCache`` (the default; fixed-size
caches such as ``cache_implementation="static"`` or ``"sliding_window"`` are refused in one line) and applies the
same windows to it, so ``generate`` computes exactly what one forward pass over the whole text computes.
The cache is not trimmed to the windows: it costs as much memory as a model without windows (under grouped-query
attention it holds the key/value heads, not one copy per query head).

Past the trained length (``max_position_embeddings``) the table still holds: a head whose window equals the trained
length slides at that length. Documents are not masked from each other even for models trained with document
masking (aah's own generation does not either): give the model one document at a time.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_aah import AAHTransformersConfig

# transformers renamed the cache argument and output field from ``past_key_values`` to ``cache`` (5.x); the model
# accepts both names and fills the field the installed version defines.
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` ``[B, H, T, D]``: ``x * cos + (-x2, x1) * sin`` with ``x = (x1, x2)`` halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def inv_frequencies(config: AAHTransformersConfig, device=None) -> torch.Tensor:
    """RoPE's inverse frequencies ``[head_dim / 2]`` (float32): ``rope_base ** (-2i / D)``, then the scaling:
    ``linear`` divides every frequency by ``rope_factor``; ``llama3`` (Llama 3.1) divides those whose wavelength
    exceeds ``original / low_freq_factor`` by it, keeps those below ``original / high_freq_factor``, and blends the
    two linearly in ``original / wavelength`` between."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    kind, factor = config.rope_scaling_type, config.rope_factor
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        original = config.rope_original_max_position_embeddings
        low, high = config.rope_low_freq_factor, config.rope_high_freq_factor
        kept = original / (2 * math.pi / inv_freq)  # periods of the original context per wavelength
        smooth = ((kept - low) / (high - low)).clamp(0, 1)  # 0: long waves (scaled), 1: short waves (kept)
        return (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return inv_freq


def rotary_tables(
    position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[B, 1, T, D]`` at integer positions ``[B, T]``, computed in float32 and cast to ``dtype``."""
    freqs = position_ids.to(torch.float32).unsqueeze(-1) * inv_freq  # [B, T, D/2]
    angles = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def window_masks(
    windows: torch.Tensor, past: int, length: int, key_padding: torch.Tensor | None, sink: int = 0
) -> list[torch.Tensor]:
    """One boolean mask per layer, ``[B or 1, H, length, past + length]``: True where query ``past + t`` may attend
    to key ``j``, i.e. ``0 <= past + t - j`` and (``past + t - j < W[h]`` or ``j < sink``: the attention sink), and key
    ``j`` is not padding. Layers with the same row of windows share one mask.

    A real token always sees itself (every window is at least 1), so only padding queries could be left without any
    key, which would make their attention NaN; they are given their own position (their outputs are never used)."""
    device = windows.device
    query = torch.arange(past, past + length, device=device)
    key = torch.arange(past + length, device=device)
    distance = (query.view(-1, 1) - key.view(1, -1)).view(1, 1, length, past + length)
    masks, built = [], {}
    for row in windows:
        key_of_row = tuple(row.tolist())
        if key_of_row not in built:
            allowed = (distance >= 0) & ((distance < row.view(1, -1, 1, 1)) | (key.view(1, 1, 1, -1) < sink))
            if key_padding is not None:
                allowed = (allowed & key_padding.view(key_padding.shape[0], 1, 1, -1)) | (distance == 0)
            built[key_of_row] = allowed
        masks.append(built[key_of_row])
    return masks


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (torch's ``nn.RMSNorm``, which aah trains with,
    written out for the torch versions before it)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(config: AAHTransformersConfig, dim: int) -> nn.Module:
    """The norm of ``config.norm`` over ``dim`` channels (LayerNorm has a bias only with ``config.bias``)."""
    if config.norm == "rmsnorm":
        return RMSNorm(dim, config.layer_norm_eps)
    return nn.LayerNorm(dim, eps=config.layer_norm_eps, bias=config.bias)


class AAHAttention(nn.Module):
    """``num_attention_heads`` query heads, ``num_key_value_heads`` key/value heads (query head ``h`` reads key/value
    head ``h // group``). The fused ``qkv`` projection holds the rows of q, then k, then v."""

    def __init__(self, config: AAHTransformersConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.qkv = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.bias or config.qkv_bias)
        self.proj = nn.Linear(q_size, config.hidden_size, bias=config.bias)
        if config.qk_norm:  # one norm over each head's channels, shared by the heads
            self.q_norm, self.k_norm = make_norm(config, self.head_dim), make_norm(config, self.head_dim)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, mask, cache: Cache | None, eager: bool = False):
        """The attention output, and with ``eager`` also its weights ``[B, H, T, past + T]`` (the same softmax,
        computed explicitly instead of by ``scaled_dot_product_attention``, which does not return them)."""
        B, T, _ = x.shape
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = (t.view(B, T, -1, D).transpose(1, 2) for t in self.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotate_half(q, cos, sin), rotate_half(k, cos, sin)
        if cache is not None:  # keys are cached after the rotation, at their absolute positions (key/value heads)
            k, v = cache.update(k, v.contiguous(), self.layer_idx)
        if Hkv != H:  # every query head with its key/value head
            k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        weights = None
        if eager:
            scores = (q @ k.transpose(-2, -1)) * (D**-0.5)
            weights = scores.masked_fill(~mask, float("-inf")).float().softmax(dim=-1).to(q.dtype)
            y = weights @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v.contiguous(), attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, H * D)), weights


class AAHMLP(nn.Module):
    """``proj(gelu(fc x))``."""

    def __init__(self, config: AAHTransformersConfig):
        super().__init__()
        self.fc = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class AAHSwiGLU(nn.Module):
    """The Llama family's gated MLP: ``proj(silu(gate x) * up x)``."""

    def __init__(self, config: AAHTransformersConfig):
        super().__init__()
        self.gate = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)
        self.up = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.gate(x)) * self.up(x))


class AAHBlock(nn.Module):
    def __init__(self, config: AAHTransformersConfig, layer_idx: int):
        super().__init__()
        self.ln1 = make_norm(config, config.hidden_size)
        self.attn = AAHAttention(config, layer_idx)
        self.ln2 = make_norm(config, config.hidden_size)
        self.mlp = AAHSwiGLU(config) if config.mlp == "swiglu" else AAHMLP(config)

    def forward(self, x, cos, sin, mask, cache, eager: bool = False):
        y, weights = self.attn(self.ln1(x), cos, sin, mask, cache, eager)
        x = x + y
        return x + self.mlp(self.ln2(x)), weights


class AAHPreTrainedModel(PreTrainedModel):
    config_class = AAHTransformersConfig
    base_model_prefix = "model"
    _no_split_modules = ["AAHBlock"]
    supports_gradient_checkpointing = False
    # attn_implementation: "sdpa" (the default: scaled_dot_product_attention with the window mask) or "eager" (the
    # same softmax computed explicitly; also what output_attentions uses). No FlashAttention: its masks are not
    # per-head windows.
    _supports_sdpa = True


class AAHModel(AAHPreTrainedModel):
    """The decoder without the output layer: token ids -> final hidden states (after the last norm)."""

    _auto_class = "AutoModel"  # as AAHForCausalLM's

    def __init__(self, config: AAHTransformersConfig):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(AAHBlock(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = make_norm(config, config.hidden_size)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.wte = value

    @property
    def windows(self) -> torch.Tensor:
        """The window table ``int32 [n_layer, n_head]`` (read from the config, which is what gets saved)."""
        return torch.tensor(self.config.windows, dtype=torch.int32)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ):
        cache = cache if cache is not None else past_key_values
        if output_attentions is None:
            output_attentions = bool(getattr(self.config, "output_attentions", False))
        if output_hidden_states is None:
            output_hidden_states = bool(getattr(self.config, "output_hidden_states", False))
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        x = self.wte(input_ids) if inputs_embeds is None else inputs_embeds
        B, T, _ = x.shape
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache()
        if cache is not None and not isinstance(cache, DynamicCache):
            # A fixed-size cache (cache_implementation "static", "sliding_window", "hybrid", ...) holds no positions
            # past its length and is masked by transformers, not by the window table.
            raise ValueError(
                f"aah models keep their keys and values in a DynamicCache (the default), not a "
                f"{type(cache).__name__}: pass past_key_values=DynamicCache() (or nothing), and leave "
                f"cache_implementation unset"
            )
        past = cache.get_seq_length() if cache is not None else 0

        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=x.device).unsqueeze(0).expand(B, T)
        cos, sin = rotary_tables(position_ids, inv_frequencies(self.config, x.device), x.dtype)

        key_padding = None
        if attention_mask is not None:
            if attention_mask.dim() != 2:
                raise ValueError("attention_mask must be 2-D [batch, past + new tokens] (1 = token, 0 = padding)")
            if attention_mask.shape[1] != past + T:
                raise ValueError(
                    f"attention_mask covers {attention_mask.shape[1]} tokens; the cache and the input hold {past + T}"
                )
            key_padding = attention_mask.to(device=x.device, dtype=torch.bool)
            if bool(key_padding.all()):
                key_padding = None
        masks = window_masks(self.windows.to(x.device), past, T, key_padding, getattr(self.config, "sink", 0))

        eager = output_attentions or getattr(self.config, "_attn_implementation", None) == "eager"
        hidden_states, attentions = [], []
        for block, mask in zip(self.blocks, masks):
            hidden_states.append(x)
            x, weights = block(x, cos, sin, mask, cache, eager)
            attentions.append(weights)
        x = self.ln_f(x)
        hidden_states.append(x)  # as transformers' decoders: the embeddings, every block's input, the final output
        out = BaseModelOutputWithPast(
            last_hidden_state=x,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
            **{_CACHE_FIELD: cache if use_cache else None},
        )
        return out if return_dict is not False else out.to_tuple()


class AAHForCausalLM(AAHPreTrainedModel, GenerationMixin):
    """The aah GPT with its output layer: logits over the vocabulary, from the token embedding matrix (tied) or from
    ``lm_head`` (``tie_word_embeddings: false``)."""

    # What register_for_auto_class sets: save_pretrained then copies this code into the folder it writes (transformers
    # 4.50 does not set it when loading a folder with trust_remote_code, and saved a folder that could not load).
    _auto_class = "AutoModelForCausalLM"

    def __init__(self, config: AAHTransformersConfig):
        super().__init__(config)
        self.model = AAHModel(config)
        # Tied: the logits reuse the embedding matrix (no second weight, nothing for transformers to tie).
        tied = getattr(config, "tie_word_embeddings", True)
        self.lm_head = None if tied else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.wte = value

    def get_output_embeddings(self) -> nn.Linear | None:
        return self.lm_head

    @property
    def windows(self) -> torch.Tensor:
        """The window table ``int32 [n_layer, n_head]``."""
        return self.model.windows

    def set_windows(self, table) -> None:
        """Replace the window table (``[n_layer, n_head]`` ints >= 1); ``save_pretrained`` then saves the new one."""
        rows = [[int(w) for w in row] for row in torch.as_tensor(table).tolist()]
        old = self.config.windows
        self.config.windows = rows
        try:
            self.config.check()
        except ValueError:
            self.config.windows = old
            raise

    def generate(self, *args, **kwargs):
        """``GenerationMixin.generate``; a fixed-size ``cache_implementation`` is refused in one line before
        transformers builds it (each transformers version fails on it otherwise in its own way, or ignores it)."""
        config = kwargs.get("generation_config", args[1] if len(args) > 1 else None) or self.generation_config
        implementation = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
        if implementation not in (None, "dynamic"):
            raise ValueError(
                f"aah models keep their keys and values in a DynamicCache (the default): cache_implementation="
                f"{implementation!r} is not supported; leave cache_implementation unset"
            )
        return super().generate(*args, **kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        **kwargs,
    ):
        """Logits ``[B, T, vocab]`` (only the last ``logits_to_keep`` positions when it is > 0). With ``labels``
        (``[B, T]``, -100 = ignore), also the mean next-token cross-entropy: position ``t`` predicts label ``t + 1``."""
        hidden = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        x = hidden.last_hidden_state
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        logits = F.linear(x, self.model.wte.weight) if self.lm_head is None else self.lm_head(x)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device), ignore_index=-100
            )
        out = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=hidden.hidden_states,
            attentions=hidden.attentions,
            **{_CACHE_FIELD: hidden.get(_CACHE_FIELD)},
        )
        return out if return_dict is not False else out.to_tuple()


__all__ = ["AAHTransformersConfig", "AAHForCausalLM", "AAHModel", "AAHPreTrainedModel"]
