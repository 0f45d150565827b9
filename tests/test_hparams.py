"""The model's settings are saved once, as flat ``model.*`` hyperparameters, and a checkpoint rebuilds the model."""

import torch

from aah_lightning.cli import main
from aah_lightning.lit.module import AAHModule
from aah_lightning.model.config import GPTConfig


def test_checkpoints_rebuild_the_model_from_flat_hyperparameters(tmp_path, tiny_args):
    main(tiny_args("--model.rope_base=500.0", "--model.aah.policy=fixed", "--model.aah.window=8", steps=3))
    path = tmp_path / "ckpt" / "last.ckpt"
    ckpt = torch.load(path, weights_only=True)
    hp = ckpt["hyper_parameters"]
    assert hp["n_layer"] == 2 and hp["n_head"] == 4 and hp["rope_base"] == 500.0 and hp["aah"]["window"] == 8
    expected = GPTConfig(vocab_size=hp["vocab_size"], seq_len=32, n_layer=2, n_head=4, n_embd=32, rope_base=500.0)
    # as the CLI wrote it (Lightning adds how it instantiated the module), and as checkpoints of code driving the
    # Trainer directly (or of earlier versions) hold it: the flat settings only
    flat = dict(ckpt, hyper_parameters={k: v for k, v in hp.items() if k != "_instantiator"})
    torch.save(flat, tmp_path / "flat.ckpt")
    for saved in (path, tmp_path / "flat.ckpt"):
        module = AAHModule.load_from_checkpoint(saved)
        assert module.gpt_config == expected
        assert module.model.windows.tolist() == [[8] * 4] * 2
        assert torch.equal(module.model.wte.weight, ckpt["state_dict"]["model.wte.weight"])
