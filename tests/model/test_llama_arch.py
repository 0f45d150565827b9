"""The Llama family's settings of ``GPTConfig``: defaults that keep the GPT as it was, each setting's effect, RoPE
scaling, and one-line refusals."""

from __future__ import annotations

import math

import pytest
import torch

from aah_lightning.errors import ConfigError
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT, rope_frequencies

# The parameter names and shapes of the default GPT (what every existing checkpoint holds), per block.
DEFAULT_BLOCK = {
    "ln1.weight": (32,),
    "attn.qkv.weight": (96, 32),
    "attn.proj.weight": (32, 32),
    "ln2.weight": (32,),
    "mlp.fc.weight": (128, 32),
    "mlp.proj.weight": (32, 128),
}


def test_the_default_gpt_keeps_its_parameter_names_and_shapes():
    model = GPT(GPTConfig(seq_len=16, n_layer=1, n_head=4, n_embd=32))
    state = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    want = {f"blocks.0.{k}": v for k, v in DEFAULT_BLOCK.items()}
    want |= {"wte.weight": (257, 32), "ln_f.weight": (32,), "lm_head.weight": (257, 32), "windows": (1, 4)}
    assert state == want
    assert model.lm_head.weight is model.wte.weight  # tied
    assert isinstance(model.blocks[0].ln1, torch.nn.LayerNorm) and model.blocks[0].ln1.eps == 1e-5


def test_llama_settings_build_the_llama_layout():
    cfg = GPTConfig(
        seq_len=16,
        n_layer=1,
        n_head=4,
        n_kv_head=2,
        head_size=6,
        n_embd=32,
        mlp="swiglu",
        mlp_hidden=40,
        norm="rmsnorm",
        norm_eps=1e-6,
        qkv_bias=True,
        qk_norm=True,
        tie_embeddings=False,
    )
    model = GPT(cfg)
    state = {k: tuple(v.shape) for k, v in model.state_dict().items() if k.startswith("blocks.0.")}
    assert state == {
        "blocks.0.ln1.weight": (32,),
        "blocks.0.attn.qkv.weight": ((4 + 2 * 2) * 6, 32),
        "blocks.0.attn.qkv.bias": (48,),
        "blocks.0.attn.proj.weight": (32, 24),
        "blocks.0.attn.q_norm.weight": (6,),
        "blocks.0.attn.k_norm.weight": (6,),
        "blocks.0.ln2.weight": (32,),
        "blocks.0.mlp.gate.weight": (40, 32),
        "blocks.0.mlp.up.weight": (40, 32),
        "blocks.0.mlp.proj.weight": (32, 40),
    }
    assert model.lm_head.weight is not model.wte.weight
    assert isinstance(model.ln_f, torch.nn.RMSNorm) and model.ln_f.eps == 1e-6
    assert model(torch.randint(257, (2, 16))).shape == (2, 16, 257)


def test_swiglu_is_the_gated_silu():
    cfg = GPTConfig(seq_len=8, n_layer=1, n_head=2, n_embd=16, mlp="swiglu", mlp_hidden=24)
    mlp = GPT(cfg).blocks[0].mlp
    x = torch.randn(3, 16)
    gate, up = x @ mlp.gate.weight.t(), x @ mlp.up.weight.t()
    want = (gate * torch.sigmoid(gate) * up) @ mlp.proj.weight.t()
    torch.testing.assert_close(mlp(x), want)


def test_rope_linear_scaling_divides_every_frequency():
    base = GPTConfig(n_head=4, n_embd=64)
    linear = GPTConfig(n_head=4, n_embd=64, rope_scaling="linear", rope_factor=4.0)
    torch.testing.assert_close(rope_frequencies(linear), rope_frequencies(base) / 4)


def test_rope_llama3_scaling_per_wavelength():
    """Llama 3.1's rule written per frequency: long wavelengths scaled, short kept, a linear blend in between."""
    cfg = GPTConfig(
        n_head=1,
        n_embd=64,
        rope_base=500000.0,
        rope_scaling="llama3",
        rope_factor=8.0,
        rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0,
        rope_original_seq_len=64,
    )
    plain = rope_frequencies(GPTConfig(n_head=1, n_embd=64, rope_base=500000.0)).tolist()
    got = rope_frequencies(cfg).tolist()
    kinds = set()
    for f, g in zip(plain, got):
        wavelength = 2 * math.pi / f
        if wavelength < 64 / 4:
            want, kind = f, "kept"
        elif wavelength > 64 / 1:
            want, kind = f / 8, "scaled"
        else:
            t = (64 / wavelength - 1) / (4 - 1)
            want, kind = (1 - t) * f / 8 + t * f, "blended"
        kinds.add(kind)
        assert g == pytest.approx(want, rel=1e-6)
    assert kinds == {"kept", "scaled", "blended"}  # the test reaches every branch


@pytest.mark.parametrize(
    "settings, words",
    [
        ({"n_head": 4, "n_kv_head": 3}, "model.gpt.n_head=4 is not divisible by model.gpt.n_kv_head=3"),
        ({"n_kv_head": 0}, "model.gpt.n_kv_head=0"),
        ({"mlp": "relu"}, "model.gpt.mlp='relu'"),
        ({"norm": "batchnorm"}, "model.gpt.norm='batchnorm'"),
        ({"rope_scaling": "yarn"}, "model.gpt.rope_scaling='yarn'"),
        ({"head_size": 7}, "head size 7 is odd"),
        ({"rope_scaling": "llama3", "rope_low_freq_factor": 4.0}, "model.gpt.rope_low_freq_factor=4.0"),
    ],
)
def test_bad_settings_are_one_line_naming_the_setting(settings, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("(", r"\(")) as err:
        GPTConfig(**settings)
    assert "\n" not in str(err.value)
