"""End to end: on the synthetic task the controller gives the copying heads the long window, the others short ones.

The task (aah_lightning/data/synthetic.py): a first-order Markov prefix of T/2 tokens, then copies at distance
T/2. Predicting a copy needs a head that looks back T/2 - 1 tokens; the Markov part needs no attention at all.
The heads that nothing needs attend diffusely over the whole context, so with the coverage target alone they keep
long windows (docs/controller.md has the numbers); under a compute ceiling the reach allocator spends the compute
where the mass gain is, which is on the copying heads.
"""

import lightning as L
import pytest
import torch

from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.module import AAHModule, OptimConfig
from aah_lightning.model.config import GPTConfig
from aah_lightning.windows.config import AAHConfig
from aah_lightning.windows.probe import run_probe
from helpers.controller_inputs import controller_settings

T = 32
COPY = T // 2 - 1  # query-key distance of the token to copy


@pytest.mark.heavy
@pytest.mark.parametrize("scope", ["layer", "model"])
def test_copying_heads_get_the_long_windows_and_the_rest_short_ones(scope):
    L.seed_everything(0)
    # No test blocks: the training order these thresholds were set on (a test split shifts the permutation).
    dm = TextDataModule(
        source="synthetic", seq_len=T, batch_size=16, synthetic={"documents": 20000}, seed=0, test_fraction=0.0
    )
    controller = controller_settings(warmup_steps=150, control_interval=50, target_acr=0.35, budget_scope=scope)
    module = AAHModule(
        gpt=GPTConfig(n_layer=2, n_head=4, n_embd=64, seq_len=T, vocab_size=dm.vocab_size, backend="sdpa"),
        aah=AAHConfig(policy="adaptive", candidates=[4, 8, 16, 32], controller=controller),
        optim=OptimConfig(lr=1e-2, warmup_steps=20),
    )
    trainer = L.Trainer(
        max_steps=600,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, dm)
    windows = module.model.windows
    assert module.policy.decisions == 9

    long_heads = windows > COPY  # the copy source is inside the window
    short_heads = windows <= 8
    assert long_heads.sum() >= 1
    assert short_heads.sum() > windows.numel() // 2
    # Per-head allocation really happened: some layer holds a long and a short window side by side.
    assert any(len(set(row.tolist())) > 1 for row in windows), windows.tolist()

    # The long windows went to the heads that copy: the head whose full-causal attention lies most on the copy
    # source (distance COPY, or the token before it) holds a long window.
    tokens = torch.stack([dm.train_set[i]["tokens"] for i in range(8)])[:, :-1]
    probe = run_probe(module.model, tokens, n_sequences=8, n_queries=T)
    dist = probe.distances()
    copying = probe.queries > COPY
    on_source = torch.stack(
        [(p[:, :, copying] * ((dist[copying] - COPY).abs() <= 1)).sum(-1).mean(dim=(0, 2)) for p in probe.probs]
    )  # [L, H]
    assert float(on_source.max()) > 0.3
    assert long_heads.flatten()[on_source.argmax()]

    # And with those windows the model copies: loss on the copied half far below the Markov half's entropy.
    val = torch.stack([dm.val_set[i]["tokens"] for i in range(len(dm.val_set))])
    with torch.no_grad():
        logits = module.model(val[:, :-1])
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), val[:, 1:], reduction="none")
    assert ce[:, COPY:].mean() < 0.5
    assert ce[:, :COPY].mean() < 1.1  # the Markov prefix: its entropy is 0.83 nats
