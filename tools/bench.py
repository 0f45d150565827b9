"""Do the windows pay? One command, every number side by side.

    PYTHONPATH=. python tools/bench.py                  # CPU, fp32, all sections
    PYTHONPATH=. python tools/bench.py --device cuda    # GPU, bf16, flex forward+backward compiled

Sections:
  (a) attention forward+backward per backend against full-causal SDPA, at T in {1024, 2048, 4096}, for the paper's
      window mix (fractions .63/.12/.10/.15 of T/8, T/4, T/2, T over the heads, in increasing head order), next to
      causal coverage and block density. On CPU flex has no backward: its rows are forward only (inference), for the
      head order as given and for the planner's balanced order.
  (b) training-step tokens/s of a small GPT (4 layers, d=256; on CUDA 12 layers, d=768) at T=4096 with AAH windows
      (ACR ~0.3) against full causal, backend ``auto``.
  (c) AAH controller overhead at control_interval 50 (the ``adaptive`` policy, if this checkout has one).
  (d) mask rebuild time for a 12 x 12 window table at T=4096 (flex BlockMasks and banded plans).
  (e) compiled graphs added after warm-up while window values change (compiled flex).
  (f) one attention layer with its projections, heads in groups by window (``split``): the plan gathering and
      scattering q, k, v and outputs, against the layer reordering its weights instead (``head_groups``).
  (g) the learned span's ramped attention forward+backward (spans included) while it learns: the banded ramp (what
      runs) against the dense ramp (a ``[H, T, T]`` bias; how it ran before), the hard windows without a ramp, and
      full-causal SDPA, with the spans at the paper's window mix.

Times are wall-clock medians over ``--repeats`` runs after warm-up, with the [min, max] spread. The machine may be
shared: compare numbers from one run, and rerun on a quiet machine before recording.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import statistics
import sys

import torch
import torch.nn.functional as F

from aah_lightning.benchmarks import common
from aah_lightning.benchmarks.common import (
    PAPER_MIX,
    SUMMARY,
    aah_table,
    check,
    emit,
    fmt,
    machine,
    md_table,
    med,
    small_model,
    sync,
    timeit,
    train_step,
    use_clock,
    window_mix,
)
from aah_lightning.model import masks
from aah_lightning.model.attention import AttentionPlanner, banded
from aah_lightning.model.attention.flex import FlexPlan, compiled_flex_attention
from aah_lightning.model.attention.sdpa import CausalPlan
from aah_lightning.model.window_math import default_candidates
from aah_lightning.windows import metrics

# -- helpers ------------------------------------------------------------------------------------------------------------


def flex_plan(row: torch.Tensor, seq_len: int, device) -> FlexPlan:
    """A flex plan with the heads in the given order (no balancing)."""
    return FlexPlan(tuple(row.tolist()), seq_len, masks.window_block_mask(row.to(device), seq_len))


# -- (a) attention kernels -------------------------------------------------------------------------------------------
def attention_kernels(args, device, dtype) -> str:
    rows_train, rows_infer = [], []
    H, D, B = args.heads, 64, args.batch
    for T in args.seq_lens:
        row = window_mix(T, H)
        full_row = torch.full((H,), T, dtype=torch.int32)
        cov = metrics.causal_coverage(row, T).item()
        dens = metrics.block_density(row, T, 128).item()
        band_work = sum(banded.band_pairs(int(w), T) for w in row) / (H * T * (T + 1) / 2)
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, generator=g).to(device, dtype) for _ in range(3))
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

        def fwd_bwd(plan):
            def run():
                out = plan(qg, kg, vg)
                out.backward(torch.ones_like(out))
                qg.grad = kg.grad = vg.grad = None

            return run

        planner = AttentionPlanner()
        fns = {"sdpa causal": fwd_bwd(CausalPlan(tuple(full_row.tolist()), T))}
        for name in ["banded", "sdpa"] + (["flex"] if device.type == "cuda" else []):
            fns[name] = fwd_bwd(planner.plans(row.view(1, -1).to(device), T, name)[0])
        if device.type == "cuda":
            fns["flex causal"] = fwd_bwd(flex_plan(full_row, T, device))
        results = timeit(fns, device, args.repeats)
        causal = results["sdpa causal"]
        c = med(causal)
        for name, times in results.items():
            ratio = med(times) / c
            rows_train.append(
                [
                    T,
                    name,
                    fmt(times),
                    f"{ratio:.3f}",
                    f"{cov:.3f}",
                    f"{dens:.3f}",
                    f"{band_work:.3f}",
                    "-" if name == "sdpa causal" else f"{ratio / cov:.2f}",
                ]
            )
        if T == max(args.seq_lens):
            r = med(results["banded"]) / c / cov
            check(f"(a) banded fwd+bwd / sdpa causal <= 1.5 x coverage, T={T}", r, 1.5, f"{r:.2f} x coverage")
            if device.type == "cuda":
                r = med(results["flex"]) / (med(results["flex causal"]) * dens)
                r2 = med(results["flex"]) / (c * dens)
                check(
                    f"(a) CUDA flex fwd+bwd <= 1.3 x causal x block density, T={T}",
                    max(r, r2),
                    1.3,
                    f"{r:.2f} x (flex causal x density), {r2:.2f} x (sdpa causal x density)",
                )

        # Inference (forward only): compiled flex tracks block density, whatever the head order.
        with torch.no_grad():
            flex_full = flex_plan(full_row, T, device)
            as_given = flex_plan(row, T, device)
            planned = AttentionPlanner().plans(row.view(1, -1).to(device), T, "flex")[0]
            band_plan = AttentionPlanner().plans(row.view(1, -1).to(device), T, "banded")[0]
            qc, kc, vc = (x.contiguous() for x in (q, k, v))
            fwd = timeit(
                {
                    "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                    "flex causal": lambda: flex_full(qc, kc, vc),
                    "given": lambda: as_given(qc, kc, vc),
                    "planned": lambda: planned(qc, kc, vc),
                    "banded": lambda: band_plan(q, k, v),
                },
                device,
                args.repeats,
            )
        sdpa_fwd, flex_c, given, balanced, band_fwd = (
            fwd[n] for n in ("sdpa", "flex causal", "given", "planned", "banded")
        )
        permuted = "permuted" if planned.order is not None else "not permuted"
        if T == max(args.seq_lens) and device.type == "cpu":
            for name, times in (("increasing head order", given), ("planner order", balanced)):
                for base_name, base in (("flex", flex_c), ("sdpa", sdpa_fwd)):
                    r = med(times) / (med(base) * dens)
                    check(
                        f"(a') CPU compiled flex inference, {name} <= 1.15 x {base_name} causal x block density, T={T}",
                        r,
                        1.15,
                        f"{r:.2f} x",
                    )
        for name, times in [
            ("sdpa causal", sdpa_fwd),
            ("flex causal", flex_c),
            ("flex AAH, increasing head order", given),
            (f"flex AAH, planner ({permuted})", balanced),
            ("banded AAH (no compile)", band_fwd),
        ]:
            rows_infer.append(
                [
                    T,
                    name,
                    fmt(times),
                    f"{med(times) / med(flex_c):.3f}",
                    f"{med(times) / med(sdpa_fwd):.3f}",
                    f"{dens:.3f}",
                    f"{med(times) / (med(flex_c) * dens):.2f}",
                    f"{med(times) / (med(sdpa_fwd) * dens):.2f}",
                ]
            )
    out = md_table(
        f"(a) attention forward+backward, B={B}, H={H}, D={D}, {dtype}, window mix {PAPER_MIX} of T/8..T",
        [
            "T",
            "backend",
            "ms median [min, max]",
            "time / causal",
            "causal coverage",
            "block density",
            "banded pairs / causal",
            "(time / causal) / coverage",
        ],
        rows_train,
    )
    out += "\n" + md_table(
        "(a') attention forward only (inference): compiled flex, and banded for comparison",
        [
            "T",
            "kernel",
            "ms median [min, max]",
            "/ flex causal",
            "/ sdpa causal",
            "block density",
            "/ (flex causal x density)",
            "/ (sdpa causal x density)",
        ],
        rows_infer,
    )
    return out


# -- (b) training step ----------------------------------------------------------------------------------------------
def training_step(args, device, dtype) -> tuple[str, float]:
    T, B = args.train_seq_len, args.train_batch
    runs = {"full causal": (None, "auto"), "AAH": ("aah", "auto")}
    if device.type == "cpu":
        runs["AAH, dense mask (sdpa)"] = ("aah", "sdpa")
    models, steps = {}, {}
    for name, (windows, backend) in runs.items():  # one model per variant, same initial weights
        model = models[name] = small_model(device, T, backend)
        aah = aah_table(model.cfg.n_layer, model.cfg.n_head, T)
        model.set_windows(aah if windows else torch.full_like(aah, T))
        tokens = torch.randint(model.cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(0))
        steps[name] = train_step(model, tokens.to(device), device, dtype)
    results = timeit(steps, device, args.train_repeats)
    acr, cov = metrics.acr(aah, T).item(), metrics.causal_coverage(aah, T).item()
    rows, base = [], med([B * T / (t / 1e3) for t in results["full causal"]])
    for name, times in results.items():
        tok_s = [B * T / (t / 1e3) for t in times]
        kinds = sorted({p.kind for p in models[name].attention_plans(T)})
        rows.append(
            [
                name,
                runs[name][1] + " -> " + "/".join(kinds),
                fmt(times),
                f"{med(tok_s):.0f} [{min(tok_s):.0f}, {max(tok_s):.0f}]",
                f"{med(tok_s) / base:.2f}",
            ]
        )
    speedup = med([B * T / (t / 1e3) for t in results["AAH"]]) / base
    goal = 1.15 if device.type == "cuda" else 1.3
    check(f"(b) AAH tokens/s >= {goal} x full causal, T={T}", speedup, goal, f"{speedup:.2f} x", higher_is_better=True)
    cfg = models["AAH"].cfg
    title = (
        f"(b) training step (fwd+bwd+AdamW), {cfg.n_layer} layers, d={cfg.n_embd}, {cfg.n_head} heads, "
        f"{models['AAH'].num_params() / 1e6:.1f}M params, B={B}, T={T}, {dtype}; AAH table ACR {acr:.3f}, "
        f"causal coverage {cov:.3f}"
    )
    header = ["windows", "backend -> plans", "step ms median [min, max]", "tokens/s", "vs full causal"]
    return md_table(title, header, rows), med(results["AAH"])


# -- (c) controller overhead -----------------------------------------------------------------------------------------
def controller_overhead(args, device, dtype, step_ms: float | None) -> str:
    title = "(c) controller overhead, control_interval 50"
    try:
        import aah_lightning.windows.controller  # noqa: F401
        from aah_lightning.windows.config import AAHConfig
        from aah_lightning.windows.policy_base import available_policies, make_policy
    except ImportError:
        return f"### {title}\n\nn/a (controller not available)\n"
    if "adaptive" not in available_policies():
        return f"### {title}\n\nn/a (controller not available: no 'adaptive' policy registered)\n"
    try:
        T = args.train_seq_len
        model = small_model(device, T)
        cfg = AAHConfig(policy="adaptive")
        knobs = cfg.controller.schedule  # when the controller decides
        settings = {}
        for key, value in (("control_interval", 50), ("warmup_steps", 0)):
            if hasattr(knobs, key):
                setattr(knobs, key, value)
                settings[key] = value
        policy = make_policy(cfg, model.cfg.n_layer, model.cfg.n_head, T)
        tokens = torch.randint(model.cfg.vocab_size, (args.train_batch, T + 1), device=device)
        batch = {"tokens": tokens, "doc_ids": torch.zeros_like(tokens)}
        if step_ms is None:
            step_ms = med(timeit({"step": train_step(model, tokens, device, dtype)}, device, 2)["step"])
        model.train()
        per_step, control = [], []
        for step in range(1, 151):
            start = common.CLOCK()
            table = policy.on_train_step(step, model, batch)
            if table is not None:
                model.set_windows(table)
            model.attention_plans(T)  # mask rebuild, when the table changed, belongs to the control cost
            sync(device)
            ms = (common.CLOCK() - start) * 1e3
            (control if step % 50 == 0 else per_step).append(ms)
        per_interval = sum(control) / max(1, len(control)) + 49 * statistics.mean(per_step)
        overhead = per_interval / (50 * step_ms)
        check("(c) controller overhead <= 3 %", 100 * overhead, 3.0, f"{100 * overhead:.2f} %")
        rows = [[fmt(control), f"{statistics.mean(per_step):.3f}", f"{step_ms:.0f}", f"{100 * overhead:.2f} %"]]
        return md_table(
            title + f" (settings {settings})",
            ["control step ms", "other steps ms (mean)", "training step ms", "overhead per interval"],
            rows,
        )
    except Exception as err:  # the controller is being written in parallel: report, don't crash the bench
        return f"### {title}\n\nn/a (controller failed: {type(err).__name__}: {err})\n"


# -- (d) mask rebuild -------------------------------------------------------------------------------------------------
def mask_rebuild(args, device) -> str:
    T, L, H = 4096, 12, 12
    g = torch.Generator().manual_seed(0)
    cands = torch.tensor(default_candidates(T), dtype=torch.int32)
    tables = [cands[torch.randint(4, (L, H), generator=g)].to(device) for _ in range(args.repeats + 1)]
    rows = []
    for backend in ("flex", "banded"):
        planner = AttentionPlanner()
        times = []
        for table in tables:
            start = common.CLOCK()
            planner.plans(table, T, backend)
            sync(device)
            times.append((common.CLOCK() - start) * 1e3)
        rows.append([backend, fmt(times[1:])])
        check(
            f"(d) rebuild of {L} x {H} {backend} plans at T={T} <= 50 ms",
            med(times[1:]),
            50.0,
            f"{med(times[1:]):.1f} ms",
        )
    return md_table(
        f"(d) mask rebuild, {L} layers x {H} heads, T={T}, all rows changed (planner, incl. table read)",
        ["plans", "ms median [min, max]"],
        rows,
    )


# -- (f) heads in groups ---------------------------------------------------------------------------------------------
class _Gathered:
    """The plan without ``head_groups``: the layer hands it every head's q, k, v, and it gathers and scatters them."""

    eager, head_groups = False, None

    def __init__(self, plan):
        self.plan = plan

    def __call__(self, q, k, v):
        return self.plan(q, k, v)


def heads_in_groups(args, device, dtype) -> str:
    from aah_lightning.model import gpt
    from aah_lightning.model.config import GPTConfig

    H, D, B = args.heads, 64, args.batch
    rows = []
    for T in args.seq_lens:
        g = torch.Generator().manual_seed(0)
        row = window_mix(T, H)[torch.randperm(H, generator=g)]  # the mix spread over the heads, as a controller does
        layer = gpt.CausalSelfAttention(GPTConfig(seq_len=T, n_head=H, n_embd=H * D)).to(device, dtype)
        cos, sin = gpt.Rotary(D, 10000.0)(T, device, dtype)
        x = torch.randn(B, T, H * D, generator=g).to(device, dtype).requires_grad_()
        split_plan = AttentionPlanner().plans(row.view(1, -1).to(device), T, "split")[0]
        plans = {
            "sdpa causal (all heads full)": CausalPlan(tuple([T] * H), T),
            "split, heads gathered and scattered": _Gathered(split_plan),
            "split, weights reordered (head_groups)": split_plan,
        }

        def fwd_bwd(plan):
            def run():
                out = layer(x, cos, sin, plan)
                out.backward(torch.ones_like(out))
                x.grad = None
                layer.zero_grad(set_to_none=True)

            return run

        results = timeit({name: fwd_bwd(plan) for name, plan in plans.items()}, device, args.repeats)
        causal, gathered = (
            med(results["sdpa causal (all heads full)"]),
            med(results["split, heads gathered and scattered"]),
        )
        for name, times in results.items():
            rows.append(
                [
                    T,
                    f"{B * T / (H * D):.1f}",
                    name,
                    fmt(times),
                    f"{med(times) / causal:.3f}",
                    f"{med(times) / gathered:.3f}",
                ]
            )
        grouped = med(results["split, weights reordered (head_groups)"])
        check(
            f"(f) split layer, weights reordered <= 1.1 x heads gathered, T={T}, B={B}",
            grouped / gathered,
            1.1,
            f"{grouped / gathered:.3f} x",
        )
    return md_table(
        f"(f) one attention layer (qkv, attention, output projection) forward+backward, {H} heads of {D}, batch {B}, "
        "the paper's window mix in random head order",
        ["T", "tokens / feature", "plan", "ms median [min, max]", "/ sdpa causal", "/ gathered"],
        rows,
    )


# -- (g) the learned span's ramp ---------------------------------------------------------------------------------------
def span_ramp_cost(args, device, dtype) -> str:
    from aah_lightning.model.attention.soft_span import soft_span_attention, span_ramp

    H, D, B = args.heads, 64, args.batch
    dtype = torch.promote_types(dtype, torch.float32)  # the ramp runs in fp32 at least
    rows = []
    for T in args.seq_lens:
        R = T // 32
        hard = window_mix(T, H)
        span = (hard.double() - R - 0.5).clamp(min=0).to(device, dtype).requires_grad_()  # ceil(z + R) = the mix
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, generator=g).to(device, dtype).requires_grad_() for _ in range(3))
        hard_plan = banded.build_plan(hard.tolist(), T, device=device)
        d = torch.arange(T, device=device, dtype=dtype)
        d = d.view(T, 1) - d.view(1, T)

        def dense_ramp():  # the former dense computation: every pair scored, the ramp's log as a [H, T, T] bias
            m = span_ramp(d, span.view(H, 1, 1), R)
            bias = torch.where((d >= 0) & (m > 0), torch.log(m.clamp_min(torch.finfo(dtype).tiny)), float("-inf"))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

        variants = {
            "banded ramp (runs)": lambda: soft_span_attention(q, k, v, span, R, None, hard.tolist()),
            "dense ramp": dense_ramp,
            "hard windows, banded": lambda: banded.banded_attention(q, k, v, hard_plan),
            "sdpa causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        }

        def fwd_bwd(fn):
            def run():
                fn().sum().backward()
                for x in (q, k, v, span):
                    x.grad = None

            return run

        results = timeit({name: fwd_bwd(fn) for name, fn in variants.items()}, device, args.repeats)
        dense, causal = med(results["dense ramp"]), med(results["sdpa causal"])
        for name, times in results.items():
            rows.append([T, name, fmt(times), f"{med(times) / dense:.3f}", f"{med(times) / causal:.3f}"])
        ramp = med(results["banded ramp (runs)"])
        check(f"(g) banded ramp < dense ramp, T={T}", ramp / dense, 1.0, f"{ramp / dense:.3f} x")
    return md_table(
        f"(g) the learned span's ramped attention forward+backward, {H} heads of {D}, batch {B}, ramp width T/32, "
        "hard windows at the paper's mix",
        ["T", "attention", "ms median [min, max]", "/ dense ramp", "/ sdpa causal"],
        rows,
    )


# -- (e) recompiles --------------------------------------------------------------------------------------------------
def recompiles(args, device, dtype) -> str:
    from torch._dynamo.utils import counters

    T = args.recompile_seq_len
    model = small_model(device, T, backend="flex")
    tokens = torch.randint(model.cfg.vocab_size, (1, T), device=device)
    g = torch.Generator().manual_seed(1)
    cands = torch.tensor(default_candidates(T), dtype=torch.int32)
    train = device.type == "cuda"  # flex trains only on CUDA; on CPU compiled flex serves inference

    def run():
        if train:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                model(tokens).float().sum().backward()
        else:
            with torch.no_grad():
                model(tokens)
        sync(device)

    model.set_windows(cands[torch.randint(4, model.windows.shape, generator=g)])
    model.windows[0, 0] = T // 8  # at least one windowed layer: flex runs
    run()
    run()
    before = (counters["stats"]["unique_graphs"], counters["frames"]["ok"])
    changes = 5
    for _ in range(changes):
        table = cands[torch.randint(4, model.windows.shape, generator=g)]
        table[0, 0] = T // 8
        model.set_windows(table)
        run()
    after = (counters["stats"]["unique_graphs"], counters["frames"]["ok"])
    with torch.set_grad_enabled(train):
        kinds = sorted({p.kind for p in model.attention_plans(T)})
    check(
        "(e) recompiles after warm-up == 0",
        after[0] - before[0] + after[1] - before[1],
        0,
        f"{after[0] - before[0]} graphs, {after[1] - before[1]} frames",
    )
    rows = [
        [
            f"{'fwd+bwd' if train else 'forward (no_grad)'}, T={T}",
            changes,
            "/".join(kinds),
            after[0] - before[0],
            after[1] - before[1],
        ]
    ]
    return md_table(
        "(e) recompiles after warm-up while the window values change",
        ["run", "window changes", "plans", "new graphs", "new compiled frames"],
        rows,
    )


# -- main ------------------------------------------------------------------------------------------------------------
def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="wall (default) or process CPU time: with --threads 1 on a busy machine, cpu is the steadier",
    )
    p.add_argument("--sections", default="abcdefg", help="which sections to run, e.g. 'ad'")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--heads", type=int, default=20, help="(a): 20 heads give the paper's mix 13/2/2/3")
    p.add_argument("--batch", type=int, default=None, help="(a) batch; default 1 on CPU, 8 on CUDA")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--train-seq-len", type=int, default=4096)
    p.add_argument("--train-batch", type=int, default=None, help="(b) batch; default 1 on CPU, 8 on CUDA")
    p.add_argument("--train-repeats", type=int, default=5)
    p.add_argument("--recompile-seq-len", type=int, default=1024)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    use_clock(args.clock)
    if args.threads:
        torch.set_num_threads(args.threads)  # before anything compiles: a thread change recompiles
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.batch = args.batch or (8 if device.type == "cuda" else 1)
    args.train_batch = args.train_batch or (8 if device.type == "cuda" else 1)

    command = "PYTHONPATH=. python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    emit(f"## aah benchmark, {datetime.datetime.now().isoformat(timespec='minutes')}\n")
    emit(f"command: `{command}`\n\nmachine: {machine(device)}\n")
    compiled_flex_attention()
    step_ms = None
    if "a" in args.sections:
        emit(attention_kernels(args, device, dtype))
    if "b" in args.sections:
        text, step_ms = training_step(args, device, dtype)
        emit(text)
    if "c" in args.sections:
        emit(controller_overhead(args, device, dtype, step_ms))
    if "d" in args.sections:
        emit(mask_rebuild(args, device))
    if "e" in args.sections:
        emit(recompiles(args, device, dtype))
    if "f" in args.sections:
        emit(heads_in_groups(args, device, dtype))
    if "g" in args.sections:
        emit(span_ramp_cost(args, device, dtype))
    if SUMMARY:
        emit(md_table("targets", ["target", "measured", "verdict"], SUMMARY))
    emit(f"command: `{command}`")


if __name__ == "__main__":
    main()
