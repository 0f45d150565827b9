"""Which key/value heads a pretrained model's passkey retrieval depends on, measured one head at a time.

    python tools/passkey_heads.py smol.ckpt --text /usr/share/common-licenses/GPL-1 --narrow 384 --sink 4 --acr 0.25

Passkey trials as the verdict's (``tools/retrofit_eval.py``: a five-digit key stated in held-out text, asked for at
the end), scored by the log-probability of the key's digits. For every key/value head: the *gain* of giving it the
whole context when every other head keeps ``--narrow`` tokens and the sink, and the *loss* of narrowing it alone when
every other head is whole (``experiments/retrofit_verdict.passkey_head_scan``). With ``--acr`` the controller's step-0
decision (the ``retrieval`` signal, candidates ``[--narrow, T]``) is made on the same text and its whole-context heads
are marked, to check the signal against what the passkey needs. The table lists the heads by the larger of the two. ``2 L n_kv`` passes over the trials: about 17 minutes
a direction for SmolLM2-135M with 4 trials at T = 2048 on one CPU thread. Writes ``heads.json`` and ``heads.md`` under
``--out``.
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
from aah_lightning.experiments import retrofit_verdict as rv


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--text", nargs="+", required=True, help="held-out text files (globs allowed)")
    p.add_argument(
        "--seq-len", type=int, default=2048, help="the context: a whole head's window and each probe's length"
    )
    p.add_argument("--narrow", type=int, default=384, help="every other head's window (tokens, the sink aside)")
    p.add_argument("--sink", type=int, default=4)
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--distances", default="600-1900", help="the needle's distance range, tokens")
    p.add_argument("--acr", type=float, help="mark the retrieval signal's whole heads at this budget")
    p.add_argument("--probes", type=int, default=4, help="copy probes of the retrieval decision")
    p.add_argument("--copy-span", type=int, default=32, help="tokens of each copy probe")
    p.add_argument("--seed", type=int, default=2)
    p.add_argument("--top", type=int, default=12)
    p.add_argument(
        "--precision",
        choices=rv.PRECISIONS,
        default="32-true",
        help="bf16-mixed: the scan's forwards under bfloat16 autocast (the decision stays float32)",
    )
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python tools/passkey_heads.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    model, tok = load_model(args.checkpoint)
    if tok is None:
        raise SystemExit(f"{args.checkpoint} has no text tokenizer: the passkey needs real text")
    model.eval()
    T = args.seq_len
    lo, hi = (int(x) for x in args.distances.split("-"))
    if not 0 < args.narrow < T or not 0 < lo < hi < T:
        raise SystemExit(
            f"--narrow must be in (0, {T}) and --distances lo-hi within (0, {T}), got {args.narrow}, {lo}-{hi}"
        )
    files = sorted({f for pattern in args.text for f in glob.glob(pattern)})
    hay = [int(i) for i in tok.encode("\n\n".join(open(f, encoding="utf-8", errors="replace").read() for f in files))]
    trials = rv.passkey_trials(hay, lambda s: [int(i) for i in tok.encode(s)], [(lo, hi)], args.trials, seed=args.seed)
    chosen = set()
    if args.acr is not None:
        if len(hay) < args.probes * (T + 1):
            raise SystemExit(f"--text holds {len(hay)} tokens; {args.probes} probes need {args.probes * (T + 1)}")
        probes = torch.tensor(hay[: args.probes * (T + 1)]).view(args.probes, T + 1)[:, :T]
        need, _ = rv.need_table(model, probes, args.acr, args.narrow, args.sink, args.probes, args.copy_span)
        n_kv = model.cfg.n_kv_head or model.cfg.n_head
        groups = need.view(model.cfg.n_layer, n_kv, -1)[..., 0]
        chosen = {(int(l), int(g)) for l, g in (groups >= T).nonzero().tolist()}
    t0 = time.time()
    with rv.autocast(args.precision):
        scan = rv.passkey_head_scan(
            model,
            trials,
            args.narrow,
            args.sink,
            T,
            lambda l: print(f"layer {l}: {time.time() - t0:.0f} s", flush=True),
        )
    scan["retrieval_chosen"] = sorted(chosen)
    scan["command"] = command
    gain = {(l, g): v for l, row in enumerate(scan["gain"]) for g, v in enumerate(row)}
    lost = {(l, g): v for l, row in enumerate(scan["loss"]) for g, v in enumerate(row)}
    ranked = sorted(gain, key=lambda h: max(gain[h], lost[h]), reverse=True)  # what either direction shows
    lines = [
        f"`{command}`",
        "",
        f"{len(trials)} passkeys {lo}-{hi} tokens back, precision {args.precision}; log-probability of the key's five digits: every head at "
        f"{args.narrow} + sink {args.sink}: {scan['base']:.2f}, every head whole: {scan['full']:.2f}."
        + (f" Marked *: the retrieval signal's whole heads at ACR {args.acr} ({len(chosen)})." if chosen else ""),
        "",
        "| layer, kv head | gain (widened alone) | loss (narrowed alone) |",
        "|---|---|---|",
    ]
    for l, g in ranked[: args.top]:
        lines.append(f"| {l}, {g}{' *' if (l, g) in chosen else ''} | {gain[(l, g)]:+.2f} | {lost[(l, g)]:+.2f} |")
    os.makedirs(args.out, exist_ok=True)
    atomic_write_text(os.path.join(args.out, "heads.json"), json.dumps(scan))
    atomic_write_text(os.path.join(args.out, "heads.md"), "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
