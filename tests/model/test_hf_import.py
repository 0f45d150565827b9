"""Hugging Face Llama-family folders imported as aah GPTs: tiny randomly initialised models of transformers' own
classes, saved with ``save_pretrained`` (offline), give the same float32 logits through aah; refusals are one line."""

from __future__ import annotations

import json

import pytest
import torch

from aah_lightning.errors import ConfigError
from aah_lightning.model import hf_import
from helpers.hf_models import FAMILIES, T, save_tiny


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
    assert (cfg.kv_heads, cfg.mlp, cfg.norm) == (theirs.config.num_key_value_heads, "swiglu", "rmsnorm")
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


def test_sliding_layers_of_configs_before_layer_types_follow_max_window_layers(tmp_path):
    save_tiny("qwen2_sliding", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config.pop("layer_types") == ["full_attention", "sliding_attention"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert hf_import.import_folder(tmp_path).windows.tolist() == [[T] * 4, [6] * 4]


def test_rope_settings_read_both_config_layouts():
    """transformers 5 writes ``rope_parameters`` (with the base inside); earlier versions ``rope_theta`` and
    ``rope_scaling`` (``type`` or ``rope_type``)."""
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    new = {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3}}
    old = {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **llama3}}
    want = {
        "rope_base": 5e5,
        "rope_scaling": "llama3",
        "rope_factor": 8.0,
        "rope_low_freq_factor": 1.0,
        "rope_high_freq_factor": 4.0,
        "rope_original_seq_len": 64,
    }
    assert hf_import.rope_settings(new) == hf_import.rope_settings(old) == want
    linear = {"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert hf_import.rope_settings(linear) == {"rope_base": 1e4, "rope_scaling": "linear", "rope_factor": 2.0}
    assert hf_import.rope_settings({}) == {"rope_base": 10000.0}
    with pytest.raises(ConfigError, match="partial_rotary_factor=0.5 is not supported"):
        hf_import.rope_settings({"partial_rotary_factor": 0.5})


def test_a_model_without_gqa_leaves_n_kv_head_unset(tmp_path):
    save_tiny("mistral", tmp_path, num_key_value_heads=4)
    cfg = hf_import.gpt_config(hf_import.read_config(tmp_path))
    assert cfg.n_kv_head is None and cfg.kv_heads == 4
