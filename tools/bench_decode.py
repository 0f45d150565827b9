"""Do the windows pay at inference? Prefill and per-token decode time and KV cache bytes, full context vs AAH.

    python tools/bench_decode.py                          # CPU, fp32, contexts 1024 and 4096, batch 8
    python tools/bench_decode.py --contexts 512 --repeats 3

The model is the training benchmark's (tools/bench.py: 4 layers, d=256, 4 heads on CPU), built once per context with
the same seed, so both variants have the same weights: "full" gives every head the whole context, "AAH" the paper's
window mix over all heads (T/8, T/4, T/2, T in the shares 0.63/0.12/0.10/0.15, dealt over the layers; ACR ~0.3).

For each context T, ``batch`` prompts of T tokens are prefilled (``prefill``, next to the plain forward over the same
tokens: what the prefill costs on top of it), then every decode step feeds one token per row at positions T, T+1, ...
(every ring is full and sliding: the steady state of a long generation). Times are medians over ``--repeats`` runs,
interleaved across variants so that a change in machine load hits both alike; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys

import torch

from aah_lightning.benchmarks.common import (
    SUMMARY,
    aah_table,
    check,
    emit,
    fmt,
    machine,
    md_table,
    med,
    small_model,
    timeit,
    use_clock,
)
from aah_lightning.model import generate as gen
from aah_lightning.windows import metrics


def variant_models(seq_len: int) -> dict:
    models = {}
    for name in ("full", "AAH"):
        model = small_model(torch.device("cpu"), seq_len).eval()  # same seed: same weights
        table = aah_table(model.cfg.n_layer, model.cfg.n_head, seq_len)
        model.set_windows(table if name == "AAH" else torch.full_like(table, seq_len))
        models[name] = model
    return models


def section(T: int, args) -> str:
    B = args.batch
    models = variant_models(T)
    tokens = torch.randint(257, (B, T), generator=torch.Generator().manual_seed(0))
    prompts = tokens.tolist()
    steps = args.repeats + 2  # timeit's warm-up calls and repeats: the caches must hold every position they reach

    def forward(model):
        def run():
            with torch.no_grad():
                model(tokens)

        return run

    caches = {}

    def prefill(name):
        def run():
            caches.pop(name, None)  # free the previous cache first, as a fresh generation would have it
            caches[name] = gen.prefill(models[name], prompts, steps)[0]  # the last one is decoded from

        return run

    prefill_times = timeit(
        {
            f"{kind} {name}": forward(models[name]) if kind == "forward" else prefill(name)
            for name in models
            for kind in ("forward", "prefill")
        },
        torch.device("cpu"),
        args.prefill_repeats,
        warmup=1,
    )
    nxt = torch.randint(257, (B,), generator=torch.Generator().manual_seed(1))

    def decode(name):
        return lambda: gen.decode_step(models[name], caches[name], nxt)

    decode_times = timeit({name: decode(name) for name in models}, torch.device("cpu"), args.repeats)

    table = aah_table(4, 4, T)
    cfg = models["AAH"].cfg
    rows, tok_s = [], {}
    for name, m in models.items():
        tok_s[name] = [B / (t / 1e3) for t in decode_times[name]]
        nbytes = caches[name].nbytes
        exact = gen.cache_bytes(m.windows.tolist(), T + steps, cfg.head_dim, B, sink=m.sink)
        assert nbytes == exact, (nbytes, exact)
        pre, fwd = prefill_times[f"prefill {name}"], prefill_times[f"forward {name}"]
        rows.append(
            [
                T,
                name,
                fmt(fwd),
                fmt(pre),
                f"{med(pre) / med(fwd):.2f}",
                fmt(decode_times[name]),
                f"{med(tok_s[name]):.0f}",
                f"{med(tok_s[name]) / med(tok_s['full']):.2f}",
                f"{nbytes / 2**20:.1f}",
                f"{nbytes / caches['full'].nbytes:.3f}",
            ]
        )
    ratio = med(tok_s["AAH"]) / med(tok_s["full"])
    formula = sum(min(int(w), T) for w in table.flatten()) / (table.numel() * T)
    aah_share = caches["AAH"].nbytes / caches["full"].nbytes
    check(
        f"AAH cache / full cache == sum min(W, T) / (H T) exactly, T={T}",
        abs(aah_share - formula),
        0.0,
        f"{aah_share:.4f} vs {formula:.4f}",
    )
    if T == max(args.contexts):
        check(f"AAH decode tokens/s >= 1.5 x full, T={T}", ratio, 1.5, f"{ratio:.2f} x", higher_is_better=True)
    for name in models:
        r = med(prefill_times[f"prefill {name}"]) / med(prefill_times[f"forward {name}"])
        check(f"prefill no slower than the forward ({name}, T={T}; 1.05 allows for noise)", r, 1.05, f"{r:.2f} x")
    title = (
        f"decode at context T={T}: {cfg.n_layer} layers, d={cfg.n_embd}, {cfg.n_head} heads, batch {B}, fp32; "
        f"AAH table ACR {metrics.acr(table, T).item():.3f}"
    )
    header = [
        "T",
        "windows",
        "forward ms",
        "prefill ms",
        "prefill / forward",
        "decode step ms",
        "decode tokens/s",
        "vs full",
        "KV cache MiB",
        "cache / full's",
    ]
    return md_table(title, header, rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20, help="decode steps timed per variant")
    p.add_argument("--prefill-repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="wall (default) or process CPU time: with --threads 1 on a busy machine, cpu is the steadier",
    )
    args = p.parse_args(argv)
    use_clock(args.clock)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    emit(f"## aah decode benchmark, {datetime.datetime.now().isoformat(timespec='minutes')}\n")
    emit(f"command: `{command}`\n\nmachine: {machine(torch.device('cpu'))}\n")  # after the clock is set
    for T in args.contexts:
        emit(section(T, args))
    emit(md_table("targets", ["target", "measured", "verdict"], SUMMARY))
    emit(f"command: `{command}`")


if __name__ == "__main__":
    main()
