"""Tiny randomly initialised Hugging Face Llama-family models of transformers' own classes, saved offline with
``save_pretrained``, and a word-level tokenizer.json for them."""

from __future__ import annotations

import torch

T = 24
COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=T,
    rms_norm_eps=1e-5,
)
FAMILIES = {
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8,
            },
        },
    ),
    "llama_linear_tied_mqa": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_scaling": {"rope_type": "linear", "factor": 2.0},
            "tie_word_embeddings": True,
            "num_key_value_heads": 1,
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "mistral_sliding": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "qwen2_sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {
            "use_sliding_window": True,
            "sliding_window": 6,
            "max_window_layers": 1,
        },
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16, "tie_word_embeddings": True}),
}


def save_tiny(family: str, folder, seed=0, **override):
    """A transformers model of ``family`` with random weights well away from their initial values, saved."""
    model = tiny(family, seed, **override)
    model.save_pretrained(folder)
    return model


def tiny(family: str, seed=0, **override):
    """A transformers model of ``family`` with random weights well away from their initial values."""
    config_cls, model_cls, extra = FAMILIES[family]
    import transformers

    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **override})
    config._attn_implementation = "eager"  # the reference: masks as the config says, sliding windows included
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # norms at 1 and biases at 0 would hide a wrong mapping
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.05))
    return model


def save_tokenizer(folder, vocab_size: int = 64) -> None:
    """A word-level tokenizer.json of ``vocab_size`` ids (words ``w0 w1 ...``, ``[UNK]`` and ``</s>`` last)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 2)} | {"[UNK]": vocab_size - 2, "</s>": vocab_size - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
