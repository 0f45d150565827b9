"""The window-aware FLOP count behind perf/mfu, and the peak it is divided by."""

import warnings
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from aah_lightning.lit import flops
from aah_lightning.lit.module import AAHModule
from aah_lightning.lit.throughput import Throughput, compute_dtype, default_peak_flops
from aah_lightning.model import masks
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from aah_lightning.windows.config import AAHConfig


def test_training_flops_of_a_tiny_model_by_hand():
    # 1 layer, 2 heads of size 2, width 4, MLP 16, vocab 5, T=4, windows 1 and 4.
    cfg = GPTConfig(vocab_size=5, seq_len=4, n_layer=1, n_head=2, n_embd=4)
    # matmul weights: qkv 4*12 + proj 4*4 + fc 4*16 + proj 16*4 + lm_head 5*4 = 48 + 16 + 64 + 64 + 20
    assert flops.matmul_weights(cfg) == 212
    # W=1: one key per query -> 4 pairs; W=4 = T: 1+2+3+4 = 10 pairs
    assert flops.attention_pairs([[1, 4]], 4) == 14
    # forward: 2 * 212 weights * 4 tokens + 4 * head_dim 2 * 14 pairs = 1696 + 112; training = 3 x forward
    assert flops.forward_flops(cfg, [[1, 4]], 4) == 1808
    assert flops.training_flops(cfg, [[1, 4]], 4) == 5424


def test_matmul_flops_match_torch_flop_counter_and_pairs_match_the_mask():
    cfg = GPTConfig(vocab_size=11, seq_len=16, n_layer=2, n_head=2, n_embd=8, backend="sdpa")
    model = GPT(cfg)
    table = [[4, 16], [2, 9]]
    model.set_windows(table)
    x = torch.randint(0, 11, (3, 16))
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    # torch counts every matmul of forward + backward; CPU SDPA is not among the ops it counts
    mm = sum(v for op, v in counter.get_flop_counts()["Global"].items() if "mm" in str(op))
    assert mm == 6 * flops.matmul_weights(cfg) * 16 * 3
    # the attention pairs are exactly the True entries of the masks the model runs with
    allowed = sum(
        int(masks.dense_mask(masks.window_mask_mod(torch.tensor(row)), 1, 2, 16, "cpu").sum()) for row in table
    )
    assert flops.attention_pairs(table, 16) == allowed
    assert flops.training_flops(cfg, table, 16) == mm // 3 + 12 * cfg.head_dim * allowed


def test_throughput_counts_the_current_table_and_recounts_when_it_changes():
    module = AAHModule(
        gpt=GPTConfig(n_layer=2, n_head=2, n_embd=8, seq_len=16, vocab_size=11),
        aah=AAHConfig("static", static={"table": [[4, 16], [2, 9]]}),
    )
    cb = Throughput()
    cfg = module.model.cfg
    assert cb.sequence_flops(module, 16) == flops.training_flops(cfg, [[4, 16], [2, 9]], 16)
    module.model.set_windows([[16, 16], [16, 16]])
    assert cb.sequence_flops(module, 16) == flops.training_flops(cfg, [[16, 16], [16, 16]], 16)
    assert cb.sequence_flops(module, 8) == flops.training_flops(cfg, [[16, 16], [16, 16]], 8)


def test_peak_flops_default_and_validation():
    assert default_peak_flops(torch.device("cpu"), "32-true") is None  # on CPU the user must say
    assert compute_dtype("bf16-mixed") is torch.bfloat16 and compute_dtype("16-mixed") is torch.float16
    assert compute_dtype("32-true") is torch.float32
    with pytest.raises(ValueError, match="throughput.peak_flops"):
        Throughput(peak_flops=0)


@pytest.mark.parametrize(
    "name, precision, matmul, peak",
    [
        ("NVIDIA H200", "bf16-mixed", "highest", 989e12),  # Lightning's own table does not know this name
        ("NVIDIA H200 NVL", "bf16-mixed", "highest", 835e12),
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", "highest", 989e12),
        ("NVIDIA H100 PCIe", "16-mixed", "highest", 756e12),
        ("NVIDIA H100 NVL", "bf16-true", "highest", 835e12),
        ("NVIDIA B200", "bf16-mixed", "highest", 2250e12),
        ("NVIDIA H200", "32-true", "high", 495e12),  # float32 matmuls on TF32 tensor cores
        ("NVIDIA H200", "32-true", "highest", 67e12),  # plain FP32
    ],
)
def test_peak_flops_of_current_gpus(monkeypatch, name, precision, matmul, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: matmul)
    assert default_peak_flops(torch.device("cuda", 0), precision) == peak


def test_mfu_that_cannot_be_logged_is_said_in_one_warning():
    cb = Throughput()
    trainer, module = SimpleNamespace(precision="32-true"), SimpleNamespace(device=torch.device("cpu"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        cb.on_train_start(trainer, module)
        cb.on_train_start(trainer, module)  # a second fit in the same process (e.g. a resume)
    messages = [str(w.message) for w in caught]
    assert len(messages) == 1 and messages[0].startswith("perf/mfu is not logged: no peak FLOP/s is known for cpu")
    assert "throughput.peak_flops" in messages[0] and "\n" not in messages[0]
    assert cb.peak is None


@pytest.mark.parametrize(
    "settings",
    [{}, {"n_kv_head": 1, "mlp": "swiglu", "mlp_hidden": 24, "tie_embeddings": False, "head_size": 6, "qk_norm": True}],
)
def test_matmul_weights_are_the_weights_of_every_linear_layer(settings):
    cfg = GPTConfig(vocab_size=11, seq_len=16, n_layer=2, n_head=2, n_embd=8, **settings)
    linears = [m for m in GPT(cfg).modules() if isinstance(m, torch.nn.Linear)]
    assert flops.matmul_weights(cfg) == sum(m.weight.numel() for m in linears)
