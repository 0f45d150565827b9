"""The verdict on a retrofit of a pretrained model: window tables at one budget, on held-out text and a passkey suite.

    aah import SmolLM2-135M-Instruct.Q4_1.gguf --out smol.ckpt --seq_len 2048
    python tools/retrofit_eval.py smol.ckpt --text /usr/share/common-licenses/* --acr 0.25 --out verdict/

Rows at ACR ``--acr`` (the share of the context each head keeps, its sink included): ``fixed`` (one window for all),
``streaming`` (a sink and one window for all), ``need`` (the controller's step-0 decision with the ``retrieval``
signal, one group per key/value head, candidates ``[--short, T]``) and ``random_<i>`` (as many long key/value
heads as ``need``, placed at random), beside ``full``. Each row: perplexity on ``--blocks`` blocks of ``T`` tokens,
and the passkey suite (``--per-bucket`` trials per distance bucket, the same prompts for every row). With
``--finetune-steps N`` every row is measured again as ``<row>+ft`` after N steps of a full-model fine-tune (AdamW,
one block of T tokens a step) under its own table, each from the imported weights, on ``--finetune-text`` (default:
the Python standard library's sources, the embedded corpus, which shares nothing with the held-out text). The comparisons
and their exact tests are in ``aah_lightning/experiments/retrofit_verdict.py``. Writes ``verdict.md`` and
``verdict.json`` under ``--out`` and prints the table and the command. Each row is saved under ``--out`` as it ends
(``rows.partial.json``): the same command again goes on from the first row not measured, and refuses, naming them,
settings other than those the saved rows were measured with (``--threads`` aside).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import sys
import time

import torch

from aah_lightning.atomic import atomic_write_text
from aah_lightning.checkpoint import load_model
from aah_lightning.data import corpora
from aah_lightning.experiments import retrofit_verdict as rv
from aah_lightning.windows import metrics

PARTIAL = "rows.partial.json"  # the rows measured so far, saved after each


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--text", nargs="+", required=True, help="held-out text files (globs allowed)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--acr", type=float, default=0.25)
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--short", type=int, default=384, help="the narrow candidate of the need table")
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--buckets", default="256-512,512-1024,1024-1900")
    p.add_argument("--per-bucket", type=int, default=50)
    p.add_argument("--random-draws", type=int, default=5)
    p.add_argument("--probes", type=int, default=4, help="copy probes of the retrieval signal")
    p.add_argument("--copy-span", type=int, default=32, help="tokens of each copy probe")
    p.add_argument("--finetune-steps", type=int, default=0, help="0: no fine-tuned rows")
    p.add_argument("--finetune-lr", type=float, default=2e-5)
    p.add_argument("--finetune-text", nargs="+", help="fine-tuning text files (globs); default the standard library")
    p.add_argument(
        "--precision",
        choices=rv.PRECISIONS,
        default="32-true",
        help="bf16-mixed: every forward and fine-tune under bfloat16 autocast (weights and optimizer in float32; on a "
        "CPU with AMX about twice as fast); the decision always runs in float32",
    )
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.finetune_steps < 0 or args.finetune_lr <= 0:
        p.error(
            f"--finetune-steps must be 0 or more and --finetune-lr above 0 (got {args.finetune_steps}, {args.finetune_lr:g})"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python tools/retrofit_eval.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    # Every measured row is saved as it ends; the same command again goes on from there (a stopped run keeps its rows).
    settings = {k: v for k, v in vars(args).items() if k not in ("threads", "out")}
    partial = os.path.join(args.out, PARTIAL)
    saved = json.load(open(partial)) if os.path.exists(partial) else None
    if saved is not None and saved["settings"] != settings:
        changed = sorted(
            k for k in settings.keys() | saved["settings"].keys() if settings.get(k) != saved["settings"].get(k)
        )
        raise SystemExit(
            f"{args.out} holds a verdict begun with other settings ({', '.join(changed)}): run it with those to go on, "
            "or give another --out"
        )
    model, tok = load_model(args.checkpoint)
    if tok is None:
        raise SystemExit(f"{args.checkpoint} has no text tokenizer: the verdict needs real text")
    T = args.seq_len
    files = sorted({f for pattern in args.text for f in glob.glob(pattern)})
    text = "\n\n".join(open(f, encoding="utf-8", errors="replace").read() for f in files)
    hay = [int(i) for i in tok.encode(text)]
    buckets = [tuple(int(x) for x in b.split("-")) for b in args.buckets.split(",")]
    need_blocks = (args.blocks + args.probes) * (T + 1)
    if len(hay) < need_blocks:
        raise SystemExit(
            f"--text holds {len(hay)} tokens; {args.blocks} blocks and {args.probes} probes need {need_blocks}"
        )
    blocks = torch.tensor(hay[: args.blocks * (T + 1)]).view(args.blocks, T + 1)
    probe_rows = torch.tensor(hay[args.blocks * (T + 1) : need_blocks]).view(args.probes, T + 1)[:, :T]

    def encode(s):
        return [int(i) for i in tok.encode(s)]

    trials = rv.passkey_trials(hay, encode, buckets, args.per_bucket)
    tune_blocks = None
    if args.finetune_steps:
        tune_files = (
            sorted({f for pattern in args.finetune_text for f in glob.glob(pattern)})
            if args.finetune_text
            else corpora.stdlib_files()
        )
        if set(tune_files) & set(files):
            raise SystemExit("--finetune-text shares files with --text: the held-out text must stay held out")
        tune_ids: list[int] = []
        for f in tune_files:  # only as much text as the steps read
            tune_ids += encode(open(f, encoding="utf-8", errors="replace").read() + "\n\n")
            if len(tune_ids) >= args.finetune_steps * (T + 1):
                break
        n_tune = len(tune_ids) // (T + 1)
        if n_tune == 0:
            raise SystemExit(f"--finetune-text holds {len(tune_ids)} tokens: a fine-tuning step needs {T + 1}")
        tune_blocks = torch.tensor(tune_ids[: n_tune * (T + 1)]).view(n_tune, T + 1)
    L, H = model.cfg.n_layer, model.cfg.n_head
    n_kv = model.cfg.n_kv_head or H
    t0 = time.time()
    need, need_signal = rv.need_table(model, probe_rows, args.acr, args.short, args.sink, args.probes, args.copy_span)
    decide_s = time.time() - t0
    w_fixed = rv.widest_window(T, args.acr, 0, L, H)
    w_stream = rv.widest_window(T, args.acr, args.sink, L, H)
    tables = {
        "full": (torch.full((L, H), T), 0),
        "fixed": (torch.full((L, H), w_fixed), 0),
        "streaming": (torch.full((L, H), w_stream), args.sink),
        "need": (need, args.sink),
    }
    for i, t in enumerate(rv.random_tables(need, n_kv, args.random_draws)):
        tables[f"random_{i}"] = (t, args.sink)
    imported = {k: v.clone() for k, v in model.state_dict().items()} if tune_blocks is not None else None
    rows = {}
    if saved is not None:
        if saved["need"] != need.tolist():
            raise SystemExit(f"{args.out}: the decision differs from the one its saved rows were measured under")
        rows = saved["rows"]
        print(f"going on from {partial}: {len(rows)} rows measured before", flush=True)

    def save():
        os.makedirs(args.out, exist_ok=True)
        atomic_write_text(partial, json.dumps({"settings": settings, "need": need.tolist(), "rows": rows}))

    def measure(name, table, sink, extra):
        t = time.time()
        groups = table.view(L, n_kv, H // n_kv)[..., 0]
        with rv.autocast(args.precision):
            losses, correct = rv.block_losses(model, blocks), rv.passkey_correct(model, trials)
        rows[name] = {
            "table": table.tolist(),
            "sink": sink,
            "acr": float(metrics.acr(table, T, sink)),
            "long": int((groups >= T).sum()),
            "losses": losses,
            "correct": correct,
            "trials": [(len(x), b, d) for x, b, d in trials],
            **extra,
        }
        rows[name]["wall_s"] = time.time() - t
        save()
        print(f"{name}: {rows[name]['wall_s']:.0f} s", flush=True)

    for name, (table, sink) in tables.items():
        if name in rows:
            continue
        model.set_windows(table)
        model.sink = sink
        measure(name, table, sink, {})
    if tune_blocks is not None:
        for name, (table, sink) in tables.items():
            if name + rv.FT in rows:
                continue
            model.load_state_dict(imported)  # every fine-tune starts from the imported weights
            model.set_windows(table)
            model.sink = sink
            t = time.time()
            with rv.autocast(args.precision):
                losses = rv.fine_tune(model, tune_blocks, args.finetune_steps, args.finetune_lr)
            measure(name + rv.FT, table, sink, {"finetune_losses": losses, "finetune_s": time.time() - t})
    order = list(tables) + ([n + rv.FT for n in tables] if tune_blocks is not None else [])
    rows = {n: rows[n] for n in order}  # the tables' order, however a resumed run filled them in
    md = rv.report(rows, buckets)
    where = [
        f"(layer {i // n_kv}, kv {i % n_kv})" for i, g in enumerate(need.view(L, n_kv, -1)[..., 0].flatten()) if g >= T
    ]
    head = (
        f"`{command}`\n\nT = {T}, ACR {args.acr}, sink {args.sink}, fixed window {w_fixed}, streaming window "
        f"{w_stream}, "
        + (
            f"fine-tune: {args.finetune_steps} steps of one {T}-token block, AdamW at {args.finetune_lr:g}, full model, "
            if args.finetune_steps
            else ""
        )
        + f"need: candidates [{args.short}, {T}], {args.probes} copy probes of {args.copy_span} tokens, decided in {decide_s:.0f} s; "
        f"its long key/value heads: {', '.join(where) or 'none'}.\n\n"
    )
    os.makedirs(args.out, exist_ok=True)
    atomic_write_text(os.path.join(args.out, "verdict.md"), head + md)
    atomic_write_text(
        os.path.join(args.out, "verdict.json"),
        json.dumps({"command": command, "decide_s": decide_s, "need": need_signal.tolist(), "rows": rows}),
    )
    print(head + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
