#!/usr/bin/env python
"""Does aah train correctly, and without recompiling, on this GPU? Prints one table; exit status 1 if a check fails.

    python tools/gpu_check.py                 # CUDA GPU, about 3-4 minutes with a cold compile cache
    python tools/gpu_check.py --quick         # smaller shapes, no activation-checkpointing run
    python tools/gpu_check.py --budget 600    # always run the activation-checkpointing check (skipped past ~170 s)
    python tools/gpu_check.py --device cpu    # dry run on CPU: forward-only checks (CPU flex has no backward)

Needs nothing beyond the aah package and its dependencies (run from the repository root, or with aah installed).

Checks (docs/scaling.md, "GPU check"):
  attention parity   every plan but sdpa (banded, flex, flex_tuned, flex_fa4, fa4_window, split, varlen where they
                     run) with per-head windows against a float64 dense masked softmax: output and dq, dk, dv in fp32
                     and bf16 (the FlashAttention plans varlen, flex_fa4, fa4_window: bf16 only). Passes if a plan's error is at most 2x that of SDPA with the same dense mask
                     and dtype (or below a small floor).
  GPT parity         the whole model, flex (and split) backend against sdpa backend, same weights and windows: loss and
                     gradients.
  compiled training  Lightning fit of AAHModule(backend=flex, compile_blocks=True) in bf16-mixed on synthetic data,
                     the random policy redrawing every head's window at every step: after warm-up no new graphs
                     (recompiles) and no graph breaks; the loss is finite and falls. Reports step time, tokens/s and
                     peak memory.
  ... with AC        the same with activation checkpointing: compiles, no recompiles, less peak memory.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from aah_lightning.model import masks
from aah_lightning.model.attention import backend_names, get_backend
from aah_lightning.model.attention.reference import max_error, parity_limit, reference_attention
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT

# Every plan (model.gpt.backend) but the dense reference, checked against the float64 reference; one that cannot run
# here says why.
PARITY_PLANS = tuple(name for name in backend_names() if name not in ("auto", "sdpa"))
ROWS: list[tuple[str, str, str, bool]] = []  # (check, measured, limit, passed)
STARTED = time.perf_counter()


def record(check: str, measured: str, limit: str, passed: bool) -> None:
    ROWS.append((check, measured, limit, bool(passed)))
    print(f"  {'ok  ' if passed else 'FAIL'} {check}: {measured} (limit {limit})", flush=True)


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


def window_row(heads: int, seq_len: int) -> torch.Tensor:
    """Windows that exercise every tile kind: tiny, off the tile grid, on it, one past it, half, full."""
    base = [1, 17, 128, 129, 300, seq_len // 2, seq_len - 1, seq_len]
    return torch.tensor([min(seq_len, base[h % len(base)]) for h in range(heads)], dtype=torch.int32)


def attention_parity(device, dtype, shape, train: bool) -> None:
    B, H, T, D = shape
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(device, dtype) for _ in range(3))
    row = window_row(H, T).to(device)
    dense = masks.dense_mask(masks.window_mask_mod(row), 1, H, T, device)
    ref_in = [t.detach().double().requires_grad_(train) for t in (q, k, v)]
    ref = reference_attention(*ref_in, row)
    d_out = torch.randn(B, H, T, D, generator=g).to(device, dtype)
    if train:
        ref.backward(d_out.double())

    def run(fn):
        inputs = [t.detach().clone().requires_grad_(train) for t in (q, k, v)]
        with torch.set_grad_enabled(train):
            out = fn(*inputs)
            if train:
                out.backward(d_out)
        errs = {"out": max_error(out, ref)}
        if train:
            for name, mine, theirs in zip(("dq", "dk", "dv"), inputs, ref_in):
                errs[name] = max_error(mine.grad, theirs.grad)
        return errs

    sdpa = run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, attn_mask=dense))
    name = str(dtype).replace("torch.", "")
    for plan_name in PARITY_PLANS:
        backend = get_backend(plan_name)
        state = backend.available(device, train)
        if not state or (backend.dtypes is not None and dtype not in backend.dtypes):
            why = state.reason if not state else f"its kernel takes {', '.join(map(str, backend.dtypes))} only"
            record(f"attention parity {name} ({plan_name})", f"skipped: {why}", "-", True)
            continue
        plan = backend.build(tuple(row.tolist()), T, None, device=device, block_size=128)
        errs = run(plan)
        for key in errs:
            limit = parity_limit(sdpa[key], dtype)
            record(
                f"attention parity {name} {key} ({plan_name})",
                f"{errs[key]:.2e} (sdpa {sdpa[key]:.2e})",
                f"{limit:.1e}",
                errs[key] <= limit,
            )


def gpt_parity(device, shape, train: bool, backend: str = "flex") -> None:
    """``backend`` and sdpa on the same weights and windows (fp32): the plumbing, not the arithmetic, is tested."""
    B, H, T, D = shape
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=97, seq_len=T, n_layer=3, n_head=H, n_embd=H * D, backend=backend)
    flex = GPT(cfg).to(device)
    sdpa = GPT(GPTConfig(**{**cfg.__dict__, "backend": "sdpa"})).to(device)
    sdpa.load_state_dict(flex.state_dict())
    row = window_row(H, T)
    table = torch.stack([row, row.flip(0), torch.full_like(row, T)])  # the last layer runs plain causal attention
    for m in (flex, sdpa):
        m.set_windows(table)
    idx = torch.randint(0, 97, (B, T + 1), device=device)
    losses, grads, logits = [], [], []
    for m in (flex, sdpa):
        with torch.set_grad_enabled(train):
            out = m(idx[:, :-1])
            loss = F.cross_entropy(out.flatten(0, 1), idx[:, 1:].flatten())
            if train:
                loss.backward()
        logits.append(out.detach())
        losses.append(loss.item())
        if train:
            grads.append(torch.cat([p.grad.flatten() for p in m.parameters()]))
    with torch.no_grad():
        kinds = "/".join(p.kind for p in flex.attention_plans(T))
    err = (logits[0] - logits[1]).abs().max().item()
    record(f"GPT parity logits {backend} vs sdpa ({kinds})", f"{err:.2e}", "1.0e-04", err < 1e-4)
    diff = abs(losses[0] - losses[1])
    record(f"GPT parity loss {backend} vs sdpa", f"{diff:.2e}", "1.0e-04", diff < 1e-4)
    if train:
        rel = ((grads[0] - grads[1]).norm() / grads[1].norm()).item()
        record(f"GPT parity gradients (relative), {backend}", f"{rel:.2e}", "1.0e-03", rel < 1e-3)


def compiled_inference(device, shape) -> None:
    """CPU dry run of what compiled training checks on a GPU: compiled blocks with flex, windows changing."""
    from aah_lightning.lit.distributed import prepare_model

    B, H, T, D = shape
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=97, seq_len=T, n_layer=2, n_head=H, n_embd=H * D, backend="flex")
    model, ref = GPT(cfg).to(device).eval(), GPT(GPTConfig(**{**cfg.__dict__, "backend": "sdpa"})).to(device).eval()
    ref.load_state_dict(model.state_dict())
    holder = type("Holder", (), {"model": model})()
    prepare_model(holder, compile_blocks=True, activation_checkpointing=False)
    idx = torch.randint(0, 97, (B, T), device=device)
    g = torch.Generator().manual_seed(1)
    cands = torch.tensor([8, 16, T // 4, T // 2, T - 1])
    errs, before = [], None
    with torch.no_grad():
        for step in range(5):
            table = cands[torch.randint(len(cands), (2, H), generator=g)]
            model.set_windows(table)
            ref.set_windows(table)
            errs.append((model(idx) - ref(idx)).abs().max().item())
            if step == 1:
                before = graphs()
    new = graphs() - before
    record("compiled blocks (inference) vs sdpa", f"{max(errs):.2e}", "1.0e-04", max(errs) < 1e-4)
    record("new graphs after warm-up, windows changing", str(new), "0", new == 0)
    record("graph breaks", str(graph_breaks()), "0", graph_breaks() == 0)


def compiled_training(args, activation_checkpointing: bool, warmup: int, steps: int) -> dict:
    """One Lightning fit; on CPU (dry run) with the sdpa backend, since CPU flex cannot train."""
    import lightning as L

    from aah_lightning.lit.datamodule import TextDataModule
    from aah_lightning.lit.module import AAHModule, OptimConfig
    from aah_lightning.windows.config import AAHConfig

    T, B = args.seq_len, args.batch_size
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    class Probe(L.Callback):
        def __init__(self):
            self.times, self.losses, self.graphs, self.tables = [], [], [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            sync()
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            sync()
            self.times.append(time.perf_counter() - self.t0)
            self.losses.append(float(outputs["loss"]))
            self.graphs.append(graphs())
            self.tables.append(pl_module.model.windows.clone())

    data = TextDataModule(source="synthetic", seq_len=T, batch_size=B, synthetic={"documents": 4 * B}, seed=0)
    cands = [T // 8, T // 4, T // 2, T - 1]  # all below T: every layer stays on the masked (flex) path
    model = AAHModule(
        gpt=GPTConfig(
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
            seq_len=T,
            vocab_size=data.vocab_size,
            backend="flex" if cuda else "sdpa",
            compile_blocks=True,
            activation_checkpointing=activation_checkpointing,
        ),
        aah=AAHConfig(policy="random", candidates=cands, random={"redraw_interval": 1}, seed=0),
        optim=OptimConfig(lr=1e-3, warmup_steps=2),
    )
    probe = Probe()
    trainer = L.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=1,
        precision="bf16-mixed" if cuda else "32-true",
        max_steps=warmup + steps,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    breaks0 = graph_breaks()
    t0 = time.perf_counter()
    trainer.fit(model, data)
    wall = time.perf_counter() - t0
    timed = probe.times[warmup:]
    changes = sum(not torch.equal(a, b) for a, b in zip(probe.tables[warmup - 1 :], probe.tables[warmup:]))
    return {
        "new_graphs": probe.graphs[-1] - probe.graphs[warmup - 1],
        "warmup_graphs": probe.graphs[warmup - 1],
        "breaks": graph_breaks() - breaks0,
        "losses": probe.losses,
        "step": statistics.median(timed),
        "first": probe.times[0],
        "wall": wall,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
        "table_changes": changes,
        "tokens": B * T,
    }


def training_checks(args) -> None:
    cuda = args.device == "cuda"
    warmup, steps = 2, (6 if args.quick or not cuda else 12)
    label = "compiled training" if cuda else "compiled training (cpu, sdpa)"
    runs = [(label, False)] + ([] if args.quick or not cuda else [("compiled training + AC", True)])
    peaks = {}
    for label, ac in runs:
        spent = time.perf_counter() - STARTED
        if ac and spent > args.budget - 100:  # the checkpointed run compiles anew (~1-2 min): keep the promised time
            record(label, f"skipped: {spent:.0f} s spent of the {args.budget} s budget (--budget)", "-", True)
            continue
        try:
            r = compiled_training(args, ac, warmup, steps if not ac else 4)
        except Exception as e:
            record(label, f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:120]}", "runs", False)
            traceback.print_exc()
            continue
        peaks[ac] = r["peak_gib"]
        changes = r["table_changes"]
        record(f"{label}: window tables changed after warm-up", str(changes), ">= 3", changes >= 3)
        record(f"{label}: new graphs after warm-up", str(r["new_graphs"]), "0", r["new_graphs"] == 0)
        record(f"{label}: graph breaks", str(r["breaks"]), "0", r["breaks"] == 0)
        losses = r["losses"]
        ok = all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
        record(f"{label}: loss first -> last", f"{losses[0]:.3f} -> {losses[-1]:.3f}", "finite, falls", ok)
        record(
            f"{label}: speed (info)",
            f"{r['step'] * 1e3:.1f} ms/step, {r['tokens'] / r['step']:,.0f} tokens/s, first step {r['first']:.0f} s "
            f"({r['warmup_graphs']} graphs in the process so far)"
            + (f", peak {r['peak_gib']:.2f} GiB" if args.device == "cuda" else ""),
            "-",
            True,
        )
    if True in peaks and False in peaks:
        record(
            "activation checkpointing saves memory",
            f"{peaks[True]:.2f} vs {peaks[False]:.2f} GiB",
            "less",
            peaks[True] < peaks[False],
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true", help="smaller shapes, skip the activation-checkpointing run")
    p.add_argument(
        "--budget",
        type=int,
        default=270,
        help="seconds; the activation-checkpointing run is skipped if it would not finish within them",
    )
    p.add_argument("--seq-len", dest="seq_len", type=int, default=None)
    p.add_argument("--batch-size", dest="batch_size", type=int, default=8)
    p.add_argument("--n-layer", dest="n_layer", type=int, default=4)
    p.add_argument("--n-head", dest="n_head", type=int, default=8)
    p.add_argument("--n-embd", dest="n_embd", type=int, default=512)
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --device cpu for a dry run of the code paths", file=sys.stderr)
        return 2
    if args.seq_len is None:
        args.seq_len = (1024 if args.quick else 2048) if cuda else 256
    if not cuda:  # a dry run: small everything
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
        args.n_layer, args.n_head, args.n_embd, args.batch_size = 2, 4, 64, 2
    T = args.seq_len
    attn_shape = (2, 8, T, 64) if cuda else (1, 4, T, 32)
    name = torch.cuda.get_device_name() if cuda else "cpu (dry run: forward only)"
    print(f"gpu_check: torch {torch.__version__}, {name}, T={T}", flush=True)
    device = torch.device(args.device)
    steps = [
        ("attention parity fp32", lambda: attention_parity(device, torch.float32, attn_shape, train=cuda)),
        ("attention parity bf16", lambda: attention_parity(device, torch.bfloat16, attn_shape, train=cuda)),
        ("GPT parity", lambda: gpt_parity(device, attn_shape, train=cuda)),
        ("GPT parity, split", lambda: gpt_parity(device, attn_shape, train=cuda, backend="split")),
    ]
    if not cuda:
        steps.append(("compiled inference", lambda: compiled_inference(device, attn_shape)))
    steps.append(("compiled training", lambda: training_checks(args)))
    for label, fn in steps:
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:
            record(label, f"error: {type(e).__name__}: {str(e).strip().splitlines()[0][:120]}", "runs", False)
            traceback.print_exc()
        print(f"  ({label}: {time.perf_counter() - t:.0f} s)", flush=True)

    width = max(len(r[0]) for r in ROWS)
    mwidth = min(100, max(len(r[1]) for r in ROWS))
    print(f"\n{'check':<{width}}  {'measured':<{mwidth}}  {'limit':<14}  result")
    print("-" * (width + mwidth + 26))
    for check, measured, limit, passed in ROWS:
        print(f"{check:<{width}}  {measured[:mwidth]:<{mwidth}}  {limit:<14}  {'ok' if passed else 'FAIL'}")
    failed = sum(not r[3] for r in ROWS)
    print(
        f"\n{len(ROWS) - failed}/{len(ROWS)} checks passed in {time.perf_counter() - STARTED:.0f} s "
        f"(torch {torch.__version__}, {name})"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
