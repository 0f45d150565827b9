"""A Lightning run resumed from a checkpoint makes exactly the controller decisions of an uninterrupted run.

The batches come from a small data module whose batch is a function of the step only, started at the step the run
resumes from: the test is about the controller's state travelling through Lightning checkpoints (module.py stores it
under ``aah_policy``), independent of how the text data module finds its position.
"""

import lightning as L
import pytest
import torch

from aah_lightning.lit.module import AAHModule, OptimConfig
from aah_lightning.model.config import GPTConfig
from aah_lightning.windows.config import AAHConfig
from helpers.controller_inputs import controller_settings
from helpers.step_data import StepData, quiet_trainer

T = 64
STEPS, STOP = 14, 7
VOCAB = 32


def batch_of(step: int) -> dict:
    """Random tokens seeded by the step, with a copy structure."""
    half = torch.randint(0, VOCAB, (4, T // 2 + 1), generator=torch.Generator().manual_seed(1000 + step))
    tokens = torch.cat([half, half[:, : T // 2]], dim=1)  # second half repeats the first
    return {"tokens": tokens, "doc_ids": torch.zeros_like(tokens)}


class Record(L.Callback):
    def __init__(self, stop_at=None):
        self.tables, self.stop_at = {}, stop_at

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.tables[trainer.global_step - 1] = pl_module.model.windows.clone()
        if trainer.global_step == self.stop_at:
            trainer.should_stop = True


# The paper's controller, reach first with the gain signal (an explorer per layer until step 8; the mass features
# still group the heads), and that with kept reach (one head holds the reach window after formation, chosen by its
# measured gain at every decision; the knapsack fill, so that the table moves here): decisions at 2, 5, 8, 11.
REACH_GAIN = {"signal": "gain", "explorers": 1, "formation_steps": 8}
MECHANISMS = {
    "mass": {},
    "reach_gain": REACH_GAIN,
    "reach_gain_kept": {**REACH_GAIN, "reach_heads": 1},
}


def run(ckpt_path=None, stop_at=None, mechanism="mass"):
    L.seed_everything(0)
    dm = StepData(batch_of, STEPS)
    controller = controller_settings(
        warmup_steps=2,
        control_interval=3,
        probe_queries=16,
        target_acr=0.45,
        depth=3,
        threshold=0.3,
        budget_over_run=True,  # the ceilings change from decision to decision, so the windows move
        **MECHANISMS[mechanism],
    )
    module = AAHModule(
        gpt=GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=T, vocab_size=VOCAB),
        aah=AAHConfig(policy="adaptive", candidates=[4, 8, 16, 32, 64], seed=5, controller=controller),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
    )
    record = Record(stop_at)
    trainer = quiet_trainer(STEPS, [record])
    trainer.fit(module, dm, ckpt_path=ckpt_path)
    return trainer, module, record.tables


@pytest.mark.heavy
@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_resumed_run_makes_the_uninterrupted_decisions(tmp_path, mechanism):
    _, straight, straight_tables = run(mechanism=mechanism)

    trainer, first, _ = run(stop_at=STOP, mechanism=mechanism)
    ckpt = tmp_path / "stop.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)  # plain tensors, lists and numbers only
    assert saved["aah_policy"]["decisions"] == 2  # steps 2 and 5

    _, resumed, resumed_tables = run(ckpt_path=str(ckpt), mechanism=mechanism)
    assert sorted(resumed_tables) == list(range(STOP, STEPS))
    for step in range(STOP, STEPS):
        assert torch.equal(resumed_tables[step], straight_tables[step]), step
    # the windows really moved (the gain signal settles sooner: explorer table, then one decided table)
    assert len({str(straight_tables[s].tolist()) for s in range(STEPS)}) > (2 if mechanism == "mass" else 1)
    if mechanism == "reach_gain_kept":  # after formation every layer (the budget unit) keeps a head at full reach
        assert all(bool((straight_tables[s] == T).any(dim=1).all()) for s in range(8, STEPS))
    a, b = straight.policy.state_dict(), resumed.policy.state_dict()
    assert a["decisions"] == b["decisions"] == 4
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key
