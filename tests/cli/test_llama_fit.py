"""``aah fit`` of a Llama-family GPT (GQA, SwiGLU, RMSNorm, q/k norm, untied output, llama3 RoPE scaling) with
per-head windows: it trains, the loss falls, and its checkpoint loads as the model that was trained."""

from __future__ import annotations

import torch

from aah_lightning import checkpoint as ck
from aah_lightning.cli import main
from helpers.tb import read_events

LLAMA = [
    "--model.gpt.n_kv_head=2",
    "--model.gpt.mlp=swiglu",
    "--model.gpt.mlp_hidden=48",
    "--model.gpt.norm=rmsnorm",
    "--model.gpt.qk_norm=true",
    "--model.gpt.tie_embeddings=false",
    "--model.gpt.rope_scaling=llama3",
    "--model.gpt.rope_factor=4.0",
    "--model.gpt.rope_original_seq_len=16",
    "--model.aah.policy=random",
    "--model.aah.candidates=[4,8,16,32]",
]


def test_a_llama_family_gpt_trains_with_windows_and_its_checkpoint_loads(tmp_path, tiny_args):
    main(tiny_args(*LLAMA, "--model.optim.lr=3e-3", steps=12))
    losses = [v for _, v in read_events(tmp_path / "runs")["scalars"]["train/loss"]]
    assert losses[-1] < losses[0]
    model, _ = ck.load_model(tmp_path / "ckpt" / "last.ckpt")
    cfg = model.cfg
    assert (cfg.kv_heads, cfg.mlp, cfg.norm, cfg.qk_norm, cfg.tie_embeddings) == (2, "swiglu", "rmsnorm", True, False)
    assert cfg.rope_scaling == "llama3" and model.blocks[0].attn.qkv.weight.shape == ((4 + 2 * 2) * 8, 32)
    table = model.windows
    assert set(table.flatten().tolist()) <= {4, 8, 16, 32} and len(set(table.flatten().tolist())) > 1
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]
    assert not torch.equal(state["model.lm_head.weight"], state["model.wte.weight"])  # untied, trained apart


def test_the_adaptive_controller_decides_on_a_gqa_model(tmp_path, tiny_args):
    """The controller's probe reads every query head (its Recording expands the key/value heads) under GQA."""
    controller = [
        "--model.aah.controller.schedule.warmup_steps=3",
        "--model.aah.controller.schedule.control_interval=3",
    ]
    gqa = ["--model.gpt.n_kv_head=1", "--model.aah.policy=adaptive", "--model.aah.candidates=[4,8,16,32]"]
    main(tiny_args(*gqa, *controller, steps=9))
    policy = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)[ck.POLICY_KEY]
    assert policy["decisions"] >= 2  # at steps 3 and 6 at least
    assert policy["ema"].shape[:2] == (2, 4) and torch.isfinite(policy["ema"]).all()  # features of each query head
