"""Hugging Face Llama-family folders imported as aah GPTs: tiny randomly initialised models of transformers' own
classes, saved with ``save_pretrained`` (offline), give the same float32 logits through aah; refusals are one line."""

from __future__ import annotations

import json

import pytest
import torch

from aah_lightning.errors import ConfigError
from aah_lightning.model import hf_import

transformers = pytest.importorskip("transformers")

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
    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**COMMON, **extra, **override})
    config._attn_implementation = "eager"  # the reference: masks as the config says, sliding windows included
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # norms at 1 and biases at 0 would hide a wrong mapping
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() == 1 else 0.05))
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_imported_logits_equal_transformers(tmp_path, family):
    theirs = save_tiny(family, tmp_path)
    ours = hf_import.import_folder(tmp_path, backend="sdpa")
    tokens = torch.randint(64, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs(tokens).logits
        got = ours(tokens)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    cfg = ours.cfg
    assert (cfg.n_kv_head, cfg.mlp, cfg.norm) == (theirs.config.num_key_value_heads, "swiglu", "rmsnorm")
    assert cfg.tie_embeddings == (ours.lm_head.weight is ours.wte.weight)
    sliding = {"mistral_sliding": [[5] * 4] * 2, "qwen2_sliding": [[T] * 4, [6] * 4]}
    assert ours.windows.tolist() == sliding.get(family, [[T] * 4] * 2)


def test_every_window_full_equals_transformers_through_the_windowed_backends(tmp_path):
    """Full windows through banded and split (the layer's GQA weight path) give transformers' logits too."""
    theirs = save_tiny("qwen3", tmp_path, seed=2)
    ours = hf_import.import_folder(tmp_path)
    tokens = torch.randint(64, (1, T), generator=torch.Generator().manual_seed(2))
    ours.set_windows(torch.full((2, 4), T + 5))
    with torch.no_grad():
        want = theirs(tokens).logits
        for backend in ("banded", "split"):
            torch.testing.assert_close(ours(tokens, backend=backend), want, rtol=1e-4, atol=1e-4)


def test_sharded_weights_are_read_through_the_index(tmp_path):
    theirs = save_tiny("llama3", tmp_path, seed=3)
    theirs.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / hf_import.INDEX_FILE).is_file()
    tokens = torch.randint(64, (1, T))
    with torch.no_grad():
        torch.testing.assert_close(
            hf_import.import_folder(tmp_path / "sharded")(tokens), theirs(tokens).logits, rtol=1e-4, atol=1e-4
        )


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "change, words",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, r"architectures=\['GPT2LMHeadModel'\]: unsupported family"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            "rope_scaling.rope_type='yarn' is not supported",
        ),
        (
            {"intermediate_size": 40},
            r"the weight blocks.0.mlp.gate.weight has shape \(48, 32\), config.json says "
            r"\(40, 32\)",
        ),
    ],
)
def test_refusals_are_one_line(tmp_path, change, words):
    save_tiny("llama3", tmp_path)
    edit_config(tmp_path, **change)
    with pytest.raises(ConfigError, match=words) as err:
        hf_import.import_folder(tmp_path)
    assert "\n" not in str(err.value)


def test_missing_files_and_weights_are_named(tmp_path):
    with pytest.raises(ConfigError, match="no config.json: not a Hugging Face model folder"):
        hf_import.import_folder(tmp_path)
    save_tiny("qwen2", tmp_path)
    weights = hf_import.read_weights(tmp_path)
    del weights["model.layers.1.self_attn.k_proj.bias"]
    cfg = hf_import.gpt_config(hf_import.read_config(tmp_path))
    with pytest.raises(ConfigError, match="the weight model.layers.1.self_attn.k_proj.bias is missing"):
        hf_import.gpt_state_dict(weights, cfg)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no model.safetensors or model.safetensors.index.json"):
        hf_import.import_folder(tmp_path)
