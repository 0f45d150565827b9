"""What the AAH controller costs, relative to training-step time, measured side by side in one run.

A GPT trains on random tokens with the ``adaptive`` policy. Every step's training part (forward, backward, AdamW) is
timed; at control steps the controller's parts are timed separately: the probe and features (``measure``), the
decision on CPU (``decide``: EMA, grouping, hierarchy, allocation) and the rebuild of the attention masks that a
changed table causes on the next forward. Overhead = controller time per control step / (control_interval x median
training-step time). Target: <= 3 % at control_interval 50.

    python tools/bench_controller.py                                   # the quickstart model on CPU
    python tools/bench_controller.py --device cuda --n-layer 12 --n-head 12 --n-embd 768 --seq-len 1024 --batch-size 8
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time

import torch

from aah_lightning.benchmarks.common import md_table, sync
from aah_lightning.data.batch import split_batch
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from aah_lightning.model.window_math import default_candidates
from aah_lightning.windows.config import AAHConfig, ControllerConfig
from aah_lightning.windows.policy_base import make_policy


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--vocab", type=int, default=257)
    p.add_argument("--control-interval", type=int, default=50)
    p.add_argument("--decisions", type=int, default=4, help="control steps to time")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compile, allocator warm-up)")
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--probe-sequences", type=int, default=2)
    p.add_argument("--probe-queries", type=int, default=64)
    p.add_argument("--bf16", action="store_true", help="autocast to bfloat16 (GPU)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = leave as is)")
    args = p.parse_args(argv)
    print("$ python tools/bench_controller.py " + shlex.join(sys.argv[1:] if argv is None else argv))
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    T, interval = args.seq_len, args.control_interval
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=args.vocab, seq_len=T, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    ).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    candidates = default_candidates(T)
    controller = ControllerConfig(
        schedule={"warmup_steps": args.warmup, "control_interval": interval},
        groups={"depth": args.depth},
        need={"probe_sequences": args.probe_sequences, "probe_queries": args.probe_queries},
        # An untrained model attends diffusely: a low target makes the table really change.
        allocation={"coverage_target": 0.5},
    )
    policy = make_policy(
        AAHConfig(policy="adaptive", candidates=candidates, controller=controller), args.n_layer, args.n_head, T
    )
    model.set_windows(policy.initial_table())

    timings = {"measure": [], "decide": [], "masks": []}

    def timed(name, fn):
        def wrapper(*a, **kw):
            sync(device)
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            sync(device)
            timings[name].append(time.perf_counter() - t0)
            return out

        return wrapper

    policy.measure = timed("measure", policy.measure)
    policy.decide = timed("decide", policy.decide)
    g = torch.Generator().manual_seed(0)
    batch = {
        "tokens": torch.randint(0, args.vocab, (args.batch_size, T + 1), generator=g).to(device),
        "doc_ids": torch.zeros(args.batch_size, T + 1, dtype=torch.long, device=device),
    }
    step_times = []
    total = args.warmup + interval * args.decisions
    changes = 0
    for step in range(total):
        table = policy.on_train_step(step, model, batch)
        if table is not None:
            changes += 1
            model.set_windows(table)
            with torch.enable_grad():  # build the training plans now, so their cost is the controller's
                timed("masks", model.attention_plans)(T)
        sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16):
            inputs, targets, _ = split_batch(batch)
            loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1).float(), targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sync(device)
        if step >= args.warmup:
            step_times.append(time.perf_counter() - t0)

    # The first control step is at the end of warmup, so every timed decision is inside the timed range.
    train_ms = statistics.median(step_times) * 1e3
    parts = {k: (sum(v) / max(1, len(v))) * 1e3 for k, v in timings.items()}
    # Mask rebuilds happen only when the table changed; spread them over all control steps.
    parts["masks"] = sum(timings["masks"]) * 1e3 / max(1, len(timings["decide"]))
    per_control = sum(parts.values())
    overhead = per_control / (interval * train_ms) * 100
    shape = f"L={args.n_layer} H={args.n_head} d={args.n_embd} T={T} B={args.batch_size}"
    print(
        f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), "
        f"{torch.get_num_threads()} CPU threads, torch {torch.__version__}, {shape}, "
        f"{len(timings['decide'])} decisions, {changes} table changes"
    )
    print()
    print(
        md_table(
            None,
            ["part", "ms"],
            [
                [f"training step (median of {len(step_times)})", f"{train_ms:.2f}"],
                ["control step: probe + features (`measure`)", f"{parts['measure']:.2f}"],
                ["control step: decision on CPU (`decide`)", f"{parts['decide']:.2f}"],
                ["control step: mask rebuild after a change", f"{parts['masks']:.2f}"],
                ["control step total", f"{per_control:.2f}"],
                [f"**overhead at control_interval {interval}**", f"**{overhead:.2f} %**"],
            ],
        )
    )


if __name__ == "__main__":
    main()
