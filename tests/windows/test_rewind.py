"""Calibrate-and-rewind: after the calibration's decision the run trains again from step 0's weights, with a fresh
optimizer and learning-rate schedule, on the table the calibration chose; resumed before or after the rewind, it ends
as the uninterrupted run."""

import copy

import lightning as L
import pytest
import torch

from aah_lightning.errors import ConfigError
from aah_lightning.lit.module import AAHModule, OptimConfig, lr_factor
from aah_lightning.lit.rewind import REWIND_KEY, Rewind
from aah_lightning.model.config import GPTConfig
from aah_lightning.windows.config import AAHConfig
from aah_lightning.windows.policy_base import make_policy
from helpers.controller_inputs import controller_settings
from helpers.step_data import StepData, quiet_trainer

T, VOCAB, STEPS, REWIND_AT = 64, 32, 8, 3


def batch_of(step: int) -> dict:
    """Random tokens seeded by the step, the second half a copy of the first."""
    half = torch.randint(0, VOCAB, (4, T // 2 + 1), generator=torch.Generator().manual_seed(1000 + step))
    return {"tokens": torch.cat([half, half[:, : T // 2]], dim=1)}


class Watch(L.Callback):
    """What each step trains: the parameters, the table, the optimizer's state and the learning rate it starts from
    (seen just before its backward, after every hook of the step's start)."""

    def __init__(self, stop_at=None):
        self.stop_at, self.initial, self.steps = stop_at, None, {}

    def on_train_start(self, trainer, pl_module):
        self.initial = copy.deepcopy(pl_module.model.state_dict())

    def on_before_backward(self, trainer, pl_module, loss):
        optimizer = trainer.optimizers[0]
        self.steps[trainer.global_step] = {
            "params": {k: v.clone() for k, v in pl_module.model.named_parameters()},
            "table": pl_module.model.windows.clone(),
            "optimizer_state": len(optimizer.state),
            "lr": optimizer.param_groups[0]["lr"],
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.stop_at:
            trainer.should_stop = True


def module(rewind: bool = True, **controller) -> AAHModule:
    settings = dict(
        warmup_steps=REWIND_AT,
        control_interval=REWIND_AT,
        freeze_after=REWIND_AT,  # the calibration's table holds after the rewind
        signal="gain",
        probe_sequences=2,
        probe_queries=16,
        target_acr=0.45,
        reach_heads=1,
    )
    c = controller_settings(**{**settings, **controller})
    c.schedule.rewind = rewind
    L.seed_everything(0)  # the same initial weights whatever ran before in this process
    return AAHModule(
        gpt=GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=T, vocab_size=VOCAB),
        aah=AAHConfig(policy="adaptive", candidates=[8, 16, 32, 64], seed=5, controller=c),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
    )


def fit(m: AAHModule, ckpt_path=None, stop_at=None) -> tuple[L.Trainer, Watch]:
    L.seed_everything(0)
    watch = Watch(stop_at)
    trainer = quiet_trainer(STEPS, [watch])
    trainer.fit(m, StepData(batch_of, STEPS), ckpt_path=ckpt_path)
    return trainer, watch


def same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


def test_the_rewind_trains_step_0s_weights_again_with_the_calibrated_table_and_a_fresh_optimizer():
    m = module()
    _, watch = fit(m)
    initial = {k: v for k, v in watch.initial.items() if k in watch.steps[0]["params"]}
    assert same(watch.steps[0]["params"], initial)
    assert not same(watch.steps[REWIND_AT - 1]["params"], initial)  # the calibration trained
    at = watch.steps[REWIND_AT]
    assert same(at["params"], initial)  # ... and the rewind put step 0's weights back
    assert at["optimizer_state"] == 0  # Adam starts again
    assert watch.steps[REWIND_AT - 1]["optimizer_state"] > 0
    # the learning-rate schedule starts again from the rewind: its warmup's first factor, then its second
    total = STEPS - REWIND_AT
    assert at["lr"] == pytest.approx(3e-3 * lr_factor(0, 2, total, 0.1))
    assert watch.steps[REWIND_AT + 1]["lr"] == pytest.approx(3e-3 * lr_factor(1, 2, total, 0.1))
    assert watch.steps[0]["lr"] == pytest.approx(3e-3 * lr_factor(0, 2, STEPS, 0.1))
    # the calibration ran at full context; the rewound run trains the table decided at the rewind, to the end
    for step in range(REWIND_AT):
        assert bool((watch.steps[step]["table"] == T).all())
    decided = at["table"]
    assert not bool((decided == T).all()) and bool((decided == T).any())  # a kept head at full reach, others less
    for step in range(REWIND_AT, STEPS):
        assert torch.equal(watch.steps[step]["table"], decided)
    assert m.rewind.initial is None  # the copy is dropped once used


def test_without_rewind_the_decision_keeps_the_trained_weights():
    _, watch = fit(module(rewind=False))
    initial = {k: v for k, v in watch.initial.items() if k in watch.steps[0]["params"]}
    assert not same(watch.steps[REWIND_AT]["params"], initial)
    assert watch.steps[REWIND_AT]["optimizer_state"] > 0


@pytest.mark.parametrize("stop_at", [REWIND_AT - 1, REWIND_AT, REWIND_AT + 2])
def test_a_run_resumed_before_at_or_after_the_rewind_ends_as_the_uninterrupted_run(tmp_path, stop_at):
    straight = module()
    fit(straight)
    trainer, _ = fit(first := module(), stop_at=stop_at)
    ckpt = tmp_path / "stop.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=True)
    # saved before the rewind (the step about to run is at most the rewind's): the initial weights travel with it
    assert (REWIND_KEY in saved) == (stop_at <= REWIND_AT)
    del first
    resumed = module()
    fit(resumed, ckpt_path=str(ckpt))
    assert same(dict(resumed.model.named_parameters()), dict(straight.model.named_parameters()))
    assert torch.equal(resumed.model.windows, straight.model.windows)


def test_a_checkpoint_from_before_the_rewind_without_the_initial_weights_is_refused():
    m = module()
    with pytest.raises(ConfigError, match="before the rewind at step 3"):
        m.rewind.start(m.model, 2)
    m.rewind.start(m.model, 4)  # after the rewind: nothing to go back to, nothing needed


def test_rewind_settings_are_checked():
    with pytest.raises(ConfigError, match="schedule.rewind.*warmup_steps >= 1"):
        module(warmup_steps=0, control_interval=1, freeze_after=None)
    with pytest.raises(ConfigError, match="schedule.rewind.*reach.explorers"):
        module(explorers=1, formation_steps=4)
    from lightning.pytorch.strategies import ModelParallelStrategy

    with pytest.raises(ConfigError, match="rewind=true is not supported under FSDP2"):
        Rewind(3).check(ModelParallelStrategy())
    Rewind(None).check(ModelParallelStrategy())  # no rewind: nothing to refuse


def test_the_chance_control_of_a_rewind_permutes_the_calibrated_table_and_rewinds_too():
    c = module().aah_config.controller
    policy = make_policy(AAHConfig(policy="shuffle", candidates=[8, 16, 32, 64], controller=c), 2, 4, T)
    assert policy.rewind_step() == REWIND_AT
    assert make_policy(AAHConfig(policy="full"), 2, 4, T).rewind_step() is None
