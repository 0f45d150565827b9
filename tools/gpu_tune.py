#!/usr/bin/env python
"""Which attention plan makes the windows pay on this GPU? One command, one table, target verdicts, JSON.

    python tools/gpu_tune.py                       # CUDA GPU, bf16; stops starting new stages after --budget s
    python tools/gpu_tune.py --out tune.json       # JSON to this file (default: $OUT/gpu_tune.json if $OUT is set)
    python tools/gpu_tune.py --smoke               # CPU, tiny shapes: every code path, no numbers worth keeping

Needs only torch (and triton on CUDA) and the aah package: no datasets, no jsonargparse. Run from the repository root.
flex_fa4 and fa4_window run where flash-attn-4 is installed (on a machine without network: tools/carry_wheels.py); the header says
which version is, and whether this torch translates aah's masks for it (model/attention/flash_compat.py).

Stages (--stages), in the order they run: attention (with parity and recompiles), e2e and e2e_compiled at T=4096,
the same at T=16384, then tuning and autotune. Each is skipped, and says so, once less than its estimated time is
left of --budget:
  parity      every plan against a float64 dense reference at the first T: output and dq, dk, dv of batch element 0,
              passing when within 2x the error of SDPA with the same dense mask and dtype (or a small floor) - the
              rule of aah_lightning/model/attention/reference.py, which tools/gpu_check.py uses too.
  attention   forward (as in training: inputs need grad) and forward+backward of every plan against SDPA's fused
              causal kernel, at T in {4096, 16384} with B x T constant (8 x 4096), H=20, D=64, the paper's window mix
              (13/2/2/3 heads on T/8, T/4, T/2, T); backward = (forward+backward) - forward. The split plan's gather
              and scatter copies (heads in a random order) are timed on their own.
  recompiles  each compiled plan, after warm-up, with new window values in the same head groups (the target: zero
              new graphs) and with a different number of windowed heads (the split plans' group sizes change).
  end to end  training-step tokens/s (forward, backward, AdamW, bf16 autocast) of the ~124M GPT (12 layers, d=768,
              12 heads) at T=4096 (B=8) and T=16384 (B=2): full causal against the paper's mix (ACR ~0.3) under
              flex, split, varlen and fa4_window (blocks eager); e2e_compiled: the same with every block compiled
              (what a GPU run configures) under flex, flex_tuned, flex_fa4, split and fa4_window, and whether
              model.gpt.backend=auto trains as fast as the fastest of them. A plan that cannot train here is listed
              with its reason.
  tuning      flex kernel_options candidates at the first T (stages, warps, TMA).
  autotune    flex under mode="max-autotune-no-cudagraphs" per BlockMask tile size, beside the pinned flex_tuned:
              inductor prints the configurations it timed; the winner is what to pin in
              aah_lightning/model/attention/flex.py (TUNED_OPTIONS).
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time

import torch

from aah_lightning.benchmarks import common as bench
from aah_lightning.benchmarks.gpu_tune import (
    Run,
    attention,
    autotuned,
    end_to_end,
    flash_facts,
    report,
    save,
    shapes,
    tuning,
)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: exercise every code path quickly")
    p.add_argument("--out", default=None, help="JSON file (default: $OUT/gpu_tune.json when $OUT is set)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds; later stages are skipped past it")
    p.add_argument(
        "--stages",
        default=None,
        help="comma-separated subset of attention,e2e,e2e_compiled,tuning,autotune (default: all; e2e_compiled runs "
        "on CPU only when named here, tuning and autotune on CUDA only)",
    )
    args = p.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_tune: no CUDA device; use --smoke for a CPU run of the code paths", file=sys.stderr)
        return 2
    # Shapes: docs/benchmarks.md's attention bench (H=20, D=64, B=8 at T=4096), B x T constant.
    args.seq_lens, args.batch, args.heads, args.head_dim = [4096, 16384], 8, 20, 64
    args.repeats, args.train_repeats, args.stage_estimate = 10, 5, 60.0
    dtype = torch.bfloat16
    if args.smoke:
        args.seq_lens, args.batch, args.heads, args.head_dim = [128, 256], 2, 6, 16
        args.repeats, args.train_repeats, args.stage_estimate = 1, 1, 0.0
        dtype = torch.float32
    stages = set((args.stages or "attention,e2e,e2e_compiled,tuning,autotune").split(","))
    # Every tuning candidate and shape is its own flex graph by design; past dynamo's default limit of 8 the rest
    # would silently run flex eagerly (dense scores) and time that instead.
    torch._dynamo.config.recompile_limit = 64
    run = Run(args.budget)
    out = args.out or (os.path.join(os.environ["OUT"], "gpu_tune.json") if os.environ.get("OUT") else None)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    print(
        f"## aah gpu_tune, {datetime.datetime.now().isoformat(timespec='minutes')}\n\ncommand: `{command}`\n\n"
        f"machine: {bench.machine(device)}\n\ntorch {torch.__version__}, FlashAttention-4: {flash_facts()}\n",
        flush=True,
    )
    for index, (T, B) in enumerate(shapes(args)):  # the first T's numbers first, then the longer T's
        if "attention" in stages:
            attention(run, args, device, dtype, T, B, first=index == 0)
            save(run, args, device, command, out)
        if "e2e" in stages:
            end_to_end(run, args, device, dtype, T, B)
            save(run, args, device, command, out)
        if "e2e_compiled" in stages and (device.type == "cuda" or args.stages):
            end_to_end(run, args, device, dtype, T, B, compiled=True)
            save(run, args, device, command, out)
    if "tuning" in stages and device.type == "cuda":
        tuning(run, args, device, dtype)
        save(run, args, device, command, out)
    if "autotune" in stages and device.type == "cuda":
        autotuned(run, args, device, dtype)
    save(run, args, device, command, out)
    print(report(run.results), flush=True)
    if out:
        print(f"JSON: {out}")
    print(f"command: `{command}`, {time.perf_counter() - run.start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
