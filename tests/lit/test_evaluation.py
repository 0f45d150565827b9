"""Loss by position bucket (against a hand computation and a manual pass), and models at other sequence lengths."""

import itertools

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from aah_lightning.checkpoint import HPARAMS_FORMAT, HPARAMS_FORMAT_ENTRY
from aah_lightning.cli import main
from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.evaluation import PositionLoss, bucket_of, widen_full_windows
from aah_lightning.lit.module import AAHModule
from aah_lightning.model.attention.reference import reference_attention
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from aah_lightning.windows.config import AAHConfig
from helpers.tb import read_events


def test_position_buckets_against_a_hand_computation():
    metric = PositionLoss()
    t = torch.arange(300, dtype=torch.float32)
    metric.update(torch.stack([t, t + 1000]))  # two sequences: loss = position, and position + 1000
    metric.update(torch.full((1, 300), 7.0))  # one more sequence: loss 7 everywhere
    got = {k: float(v) for k, v in metric.compute().items()}

    # bucket [a, b]: (sum_{t=a..b} t + sum (t + 1000) + 7 per token) / (3 tokens per position)
    def expected(a, b):
        n = b - a + 1
        s = (a + b) * n / 2
        return (2 * s + 1000 * n + 7 * n) / (3 * n)

    assert list(got) == ["0-63", "64-127", "128-255", "256-299"]
    for name, (a, b) in zip(got, [(0, 63), (64, 127), (128, 255), (256, 299)]):
        assert got[name] == pytest.approx(expected(a, b), rel=1e-6)
    assert bucket_of(torch.tensor([0, 63, 64, 127, 128, 1023, 1024, 4095])).tolist() == [0, 0, 1, 1, 2, 4, 5, 6]


def test_validation_logs_position_losses_of_a_manual_pass(tmp_path):
    torch.manual_seed(0)
    module = AAHModule(
        gpt=GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=128, vocab_size=65, backend="sdpa"),
        aah=AAHConfig(policy="fixed", fixed={"window": 16}),
    )
    data = TextDataModule(source="synthetic", seq_len=128, batch_size=4, synthetic={"documents": 64})
    trainer = L.Trainer(
        accelerator="cpu",
        limit_val_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    logged = trainer.validate(module, datamodule=data, verbose=False)[0]
    sums, counts = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for batch in itertools.islice(data.val_dataloader(), 2):
            x, y = batch["tokens"][:, :-1], batch["tokens"][:, 1:]
            ce = F.cross_entropy(module.model(x).double().transpose(1, 2), y, reduction="none")  # [B, 128]
            for i, (a, b) in enumerate([(0, 64), (64, 128)]):
                sums[i] += ce[:, a:b].sum()
                counts[i] += ce[:, a:b].numel()
    assert logged["val/loss_by_position/0-63"] == pytest.approx(float(sums[0] / counts[0]), rel=1e-5)
    assert logged["val/loss_by_position/64-127"] == pytest.approx(float(sums[1] / counts[1]), rel=1e-5)
    assert logged["val/loss"] == pytest.approx(float(sums.sum() / counts.sum()), rel=1e-5)


def test_full_heads_stay_full_at_a_longer_length():
    table = torch.tensor([[32, 8], [40, 16]], dtype=torch.int32)
    hparams = {"gpt": {"seq_len": 32}, HPARAMS_FORMAT_ENTRY: HPARAMS_FORMAT}
    ckpt = {"hyper_parameters": hparams, "state_dict": {"model.windows": table.clone()}}
    widen_full_windows(ckpt, 64)
    assert ckpt["state_dict"]["model.windows"].tolist() == [[64, 8], [64, 16]]
    shorter = {"hyper_parameters": hparams, "state_dict": {"model.windows": table.clone()}}
    widen_full_windows(shorter, 16)  # at a shorter length every W >= T is the whole context already
    assert torch.equal(shorter["state_dict"]["model.windows"], table)


def static_module(seq_len: int, **settings) -> AAHModule:
    return AAHModule(
        gpt=GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=seq_len, vocab_size=65, **settings),
        aah=AAHConfig(policy="static", static={"table": [[64, 8], [16, 64]]}),
    )


def loaded_windows(trained: AAHModule, module: AAHModule) -> list:
    """The window table ``module`` has after loading a checkpoint of ``trained`` the way Lightning does."""
    ckpt = {"hyper_parameters": dict(trained.hparams), "state_dict": trained.state_dict()}
    module.on_load_checkpoint(ckpt)
    module.load_state_dict(ckpt["state_dict"])
    return module.model.windows.tolist()


def test_a_checkpoint_loaded_at_twice_its_length_keeps_full_heads_full():
    small = static_module(64)
    assert loaded_windows(small, static_module(128)) == [[128, 8], [16, 128]]
    # trained_span: the full heads keep the trained length as a sliding window instead
    assert loaded_windows(small, static_module(128, full_heads_beyond_trained="trained_span")) == [[64, 8], [16, 64]]


class ReferencePlan:
    """One layer's float64 reference attention at its windows, as a plan (the ``LayerPlan`` contract)."""

    eager, head_groups = False, None

    def __init__(self, row: list[int]):
        self.row = row

    def __call__(self, q, k, v):
        return reference_attention(q, k, v, self.row).to(q.dtype)


def reference_forward(model: GPT, idx: torch.Tensor, monkeypatch) -> torch.Tensor:
    """The model's forward with every layer's plan replaced by the float64 reference of its windows."""
    plans = [ReferencePlan(row) for row in model.windows.tolist()]
    with monkeypatch.context() as m:
        m.setattr(model, "attention_plans", lambda *args, **kwargs: plans)
        return model(idx)


@pytest.mark.parametrize("backend", ["sdpa", "banded", pytest.param("flex", marks=pytest.mark.heavy)])
def test_forward_at_other_lengths_matches_the_reference(backend, monkeypatch):
    # A model built for T = 32 run at 16, 64 and 96 tokens: RoPE at any length, windows >= T are the whole context.
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=50, seq_len=32, n_layer=2, n_head=4, n_embd=32, backend=backend, block_size=16)
    ).eval()
    model.set_windows(torch.tensor([[32, 3, 16, 5], [1, 32, 8, 32]]))
    for length in (16, 64, 96):
        idx = torch.randint(50, (2, length))
        with torch.no_grad():
            out = model(idx)
            ref = reference_forward(model, idx, monkeypatch)
        torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize(
    "policy, backend",
    [
        ("full", "sdpa"),
        ("adaptive", "banded"),
        pytest.param("fixed", "banded", marks=pytest.mark.heavy),
        pytest.param("static", "sdpa", marks=pytest.mark.heavy),
        pytest.param("random", "banded", marks=pytest.mark.heavy),
        pytest.param("shuffle", "sdpa", marks=pytest.mark.heavy),
    ],
)
def test_validate_at_twice_the_trained_length(policy, backend, tmp_path, tiny_args):
    settings = {
        "full": [],
        "adaptive": [
            "--model.aah.controller.schedule.warmup_steps=1",
            "--model.aah.controller.schedule.control_interval=1",
            "--model.aah.controller.budget.target_acr=0.5",
        ],
        "fixed": ["--model.aah.fixed.window=16"],
        "static": ["--model.aah.static.table=[[8,64,16,32],[64,8,8,16]]"],
        "random": ["--model.aah.random.redraw_interval=1"],
        "shuffle": [
            "--model.aah.controller.schedule.warmup_steps=1",
            "--model.aah.controller.schedule.control_interval=1",
        ],
    }[policy]
    args = [
        f"--model.aah.policy={policy}",
        "--model.aah.candidates=[8,16,32,64]",
        f"--model.gpt.backend={backend}",
        *settings,
    ]
    main(tiny_args(*args, steps=3, seq_len=64))
    trained = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["state_dict"]["model.windows"]
    main(
        tiny_args(
            *args,
            f"--ckpt_path={tmp_path}/ckpt/last.ckpt",
            "--trainer.logger.init_args.name=long",
            subcommand="validate",
            seq_len=128,
        )
    )
    scalars = read_events(tmp_path / "runs" / "long")["scalars"]
    assert {"val/loss", "val/loss_by_position/0-63", "val/loss_by_position/64-127"} <= set(scalars)
    assert all(torch.isfinite(torch.tensor(v)) for _, v in scalars["val/loss_by_position/64-127"])
    if policy == "full":
        assert (trained == 64).all()  # what the validation at 128 widened to the whole context again
        # trained_span: the same checkpoint with the full heads held to the trained 64 tokens as a sliding window.
        # Positions below 64 see the same keys either way; from 64 on, the far keys are dropped.
        main(
            tiny_args(
                *args,
                f"--ckpt_path={tmp_path}/ckpt/last.ckpt",
                "--trainer.logger.init_args.name=kept",
                "--model.gpt.full_heads_beyond_trained=trained_span",
                subcommand="validate",
                seq_len=128,
            )
        )
        kept = read_events(tmp_path / "runs" / "kept")["scalars"]
        assert kept["val/loss_by_position/0-63"][-1][1] == pytest.approx(scalars["val/loss_by_position/0-63"][-1][1])
        assert kept["val/loss_by_position/64-127"][-1][1] != pytest.approx(
            scalars["val/loss_by_position/64-127"][-1][1], rel=1e-6
        )
