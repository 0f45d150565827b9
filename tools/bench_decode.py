"""Do the windows pay at inference? Prefill and per-token decode time and KV cache bytes, full context vs AAH.

    python tools/bench_decode.py                          # CPU, fp32, contexts 1024 and 4096, batch 8
    python tools/bench_decode.py --contexts 512 --repeats 3
    python tools/bench_decode.py --checkpoint smollm2/smollm2.ckpt --contexts 2048 4096 8192 --batch 1 8 \
        --json bench.json                                 # a real model: aah and its transformers export

**aah's small model** (without ``--checkpoint``): the training benchmark's model (tools/bench.py: 4 layers, d=256, 4
heads on CPU), built once per context with the same seed, so both variants have the same weights: "full" gives every
head the whole context, "AAH" the paper's window mix over all heads (T/8, T/4, T/2, T in the shares 0.63/0.12/0.10/0.15,
dealt over the layers; ACR ~0.3). For each context T, ``batch`` prompts of T tokens are prefilled (``prefill``, next
to the plain forward over the same tokens: what the prefill costs on top of it), then every decode step feeds one
token per row at positions T, T+1, ... (every ring is full and sliding: the steady state of a long generation).

**A checkpoint** (``--checkpoint``: imported with ``aah import``, or retrofitted): the same weights with windows and
with full attention, decoded by aah (``WindowKVCache``) and by transformers ``generate`` on the model ``aah export``
writes (a folder written to a temporary place and loaded with ``trust_remote_code``). The windows are
``--windows static`` (for a model without windows of its own: one key/value head in ``--full-every`` sees the whole
text, the others a ``--sink`` and the widest window within ``--acr`` at each context) or ``--windows checkpoint``
(its own table and sink; only such a measurement can go into the model card, ``aah export --bench``). Per context T:
one prompt of T tokens of real text is prefilled once per variant at batch 1 (its time: the prefill columns; aah's
windowed prefill runs the banded backend on CPU); each decode run starts from a copy of that cache, repeated to
``--batch`` rows, and decodes ``--new-tokens`` greedy tokens. Variants: aah with windows and full; the export with
windows (its default cache, ``AAHWindowCache``), with windows in a ``DynamicCache`` (the export before that cache:
every position kept, windows by the mask) and with full attention in a ``DynamicCache`` (what transformers does for a
model without windows). Ratios are against the full variant of the same side. Peak memory is the peak resident size
of the process during a run above its size before it (the cache copy, its growth and the step's buffers). The
windowed variants' greedy tokens are checked against the same model's forward without a cache over the prompt and
those tokens. ``--json`` writes every number, the tables and the command.

Times are medians over ``--repeats`` runs, interleaved across variants so that a change in machine load hits every
variant alike; compare ratios within one run.
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import datetime
import gc
import json
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass

import torch

from aah_lightning.atomic import atomic_write_text
from aah_lightning.benchmarks import common
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
from aah_lightning.checkpoint import load_model
from aah_lightning.export.model_card import file_sha256
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


def section(T: int, B: int, args) -> str:
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


# -- an imported or retrofitted checkpoint: aah and the transformers export, side by side ------------------------------
def prompt_tokens(tok, vocab_size: int, length: int) -> list[int]:
    """``length`` tokens of real text (the standard library's Python sources, through the checkpoint's tokenizer),
    or random ids for a model of token ids."""
    if tok is None:
        return torch.randint(vocab_size, (length,), generator=torch.Generator().manual_seed(0)).tolist()
    folder = os.path.dirname(os.__file__)
    ids: list[int] = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                ids += [int(i) for i in tok.encode(f.read())]
            if len(ids) >= length:
                return ids[:length]
    raise SystemExit(f"the standard library's sources hold {len(ids)} tokens, fewer than the context {length}")


def resident() -> int:
    """Bytes resident in this process now (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident() -> int:
    with open("/proc/self/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("VmHWM"))) * 1024


def reset_peak() -> bool:
    """Start the peak resident size over from now (``/proc/self/clear_refs``, Linux 4.0+); False where refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_freed_memory() -> None:
    """Give the memory the allocator keeps after frees back to the system (glibc's ``malloc_trim``), so that the next
    run's peak resident size counts the memory it takes, not blocks an earlier run left behind; a no-op elsewhere.
    (Forcing every large block through its own mapping instead would make a DynamicCache, which allocates anew at every
    step, pay page faults it does not pay in practice.)"""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def repeat_rows(cache: gen.WindowKVCache, batch: int) -> gen.WindowKVCache:
    """aah's cache of one prompt, as ``batch`` copies of it (decode speed does not depend on what the rows hold)."""
    for groups in cache.layers:
        for g in groups:
            g.k, g.v = g.k.repeat_interleave(batch, 0), g.v.repeat_interleave(batch, 0)
    cache.positions = cache.positions.repeat_interleave(batch)
    return cache


class StepClock:
    """A logits processor that only notes the time: generate calls it once per new token, after that token's forward,
    so consecutive calls are one decode step apart."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores):
        self.times.append(CLOCK_NOW())
        return scores


def CLOCK_NOW() -> float:
    return common.CLOCK()  # the clock --clock chose


def share(part: float, whole: float) -> float | None:
    """``part / whole``, None where ``whole`` measured nothing (a tiny model's cache fits in pages already resident)."""
    return part / whole if whole > 0 else None


def kv_nbytes(cache) -> int:
    """Bytes of the keys and values a transformers cache holds: the window cache's own count, a DynamicCache's
    tensors (``layers`` from transformers 4.56, ``key_cache`` / ``value_cache`` before)."""
    if hasattr(cache, "nbytes"):
        return cache.nbytes
    if hasattr(cache, "layers"):
        return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)
    return sum(t.nbytes for t in (*cache.key_cache, *cache.value_cache))


def hf_window_cache(hf, max_len: int):
    """The export's own cache class (from the folder's modeling code), sized as generate sizes it."""
    return sys.modules[type(hf).__module__].AAHWindowCache(hf.config, max_len)


@dataclass
class Variant:
    name: str
    side: str  # "aah" or "export"
    windowed: bool
    cache: str  # "window" (aah's WindowKVCache, the export's AAHWindowCache) or "dynamic" (a DynamicCache)


VARIANTS = (
    Variant("aah, windows", "aah", True, "window"),
    Variant("aah, full", "aah", False, "window"),
    Variant("export, windows", "export", True, "window"),
    Variant("export, windows, DynamicCache", "export", True, "dynamic"),
    Variant("export, full", "export", False, "dynamic"),
)


def checkpoint_section(T: int, state: dict, args) -> str:
    """Prefill, decode and memory of every variant at context ``T`` (one prompt of ``T`` tokens of real text, decoded
    ``--new-tokens`` steps; batch ``b`` decodes ``b`` copies of its cache)."""
    model, hf, tok, ckpt_table, ckpt_sink = state["model"], state["hf"], state["tok"], state["table"], state["sink"]
    cfg, n = model.cfg, args.new_tokens
    if args.windows == "static":
        table, width = common.static_table(
            cfg.n_layer, cfg.n_head, cfg.kv_heads, T, args.acr, args.sink, args.full_every
        )
        table = torch.where(table >= T, T + n, table).to(torch.int32)  # full heads see the whole run, not T only
        sink = args.sink
    else:
        table, sink, width = ckpt_table, ckpt_sink, None
    full = torch.full_like(table, T + n)
    tables = {True: table, False: full}
    prompt = prompt_tokens(tok, cfg.vocab_size, T)
    ids = torch.tensor([prompt])
    from transformers import DynamicCache, LogitsProcessorList

    def use(v: Variant):
        model.set_windows(tables[v.windowed])
        model.sink = sink
        hf.set_windows(tables[v.windowed])
        hf.config.sink = sink

    # prefill (batch 1): the cache every decode run starts from, and its time
    templates, prefill_ms = {}, {v.name: [] for v in VARIANTS}
    for _ in range(args.prefill_repeats):
        for v in VARIANTS:
            use(v)
            templates.pop(v.name, None)
            start = common.CLOCK()
            with torch.no_grad():
                if v.side == "aah":
                    templates[v.name] = gen.prefill(model, [prompt], n)  # (cache, logits after the prompt)
                else:
                    cache = DynamicCache() if v.cache == "dynamic" else hf_window_cache(hf, T + n - 1)
                    hf(ids[:, :-1], attention_mask=torch.ones_like(ids[:, :-1]), logits_to_keep=1,
                       **{state["cache_arg"]: cache})  # fmt: skip
                    templates[v.name] = cache
            prefill_ms[v.name].append((common.CLOCK() - start) * 1e3)

    def run(v: Variant, batch: int) -> tuple[list[float], list[int], int, int]:
        """One generation of ``n`` tokens from the template: step times (ms), row 0's tokens, cache bytes, peak."""
        use(v)
        gc.collect()
        release_freed_memory()
        before = resident()
        measured = reset_peak()
        times: list[float] = []
        with torch.no_grad():
            if v.side == "aah":
                cache, logits = copy.deepcopy(templates[v.name])
                repeat_rows(cache, batch)
                nxt = logits.argmax(-1).repeat_interleave(batch)
                tokens = [int(nxt[0])]
                for _ in range(n - 1):
                    start = common.CLOCK()
                    logits = gen.decode_step(model, cache, nxt)
                    nxt = logits.argmax(-1)
                    times.append((common.CLOCK() - start) * 1e3)
                    tokens.append(int(nxt[0]))
                nbytes = cache.nbytes
            else:
                cache = copy.deepcopy(templates[v.name])
                if batch > 1:
                    cache.batch_repeat_interleave(batch)
                clock = StepClock()
                rows = ids.repeat_interleave(batch, 0)
                out = hf.generate(
                    rows, attention_mask=torch.ones_like(rows), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    logits_processor=LogitsProcessorList([clock]), **{state["cache_arg"]: cache},
                )  # fmt: skip
                times = [(b - a) * 1e3 for a, b in zip(clock.times, clock.times[1:])]
                tokens = out[0, T:].tolist()
                nbytes = kv_nbytes(cache)
        peak = peak_resident() - before if measured else -1
        del cache
        return times, tokens, nbytes, peak

    rows, results, tokens_of = [], [], {}
    held = {"aah": T + n, "export": T + n - 1}  # positions each cache is sized for (generate never feeds the last)
    for batch in args.batch:
        step_ms = {v.name: [] for v in VARIANTS}
        nbytes, peak = {}, {v.name: [] for v in VARIANTS}
        for _ in range(args.repeats):
            for v in VARIANTS:
                times, tokens, nbytes[v.name], p = run(v, batch)
                step_ms[v.name] += times
                peak[v.name].append(p)
                tokens_of.setdefault(v.name, tokens)
        reference = {"aah": "aah, full", "export": "export, full"}
        for v in VARIANTS:
            tok_s = batch / (common.med(step_ms[v.name]) / 1e3)
            base = batch / (common.med(step_ms[reference[v.side]]) / 1e3)
            row = {
                "context": T, "batch": batch, "variant": v.name, "prefill_ms": common.med(prefill_ms[v.name]),
                "decode_step_ms": common.med(step_ms[v.name]), "tokens_per_s": tok_s, "vs_full": tok_s / base,
                "kv_bytes": nbytes[v.name], "kv_bytes_per_token": nbytes[v.name] / (batch * held[v.side]),
                "kv_vs_full": nbytes[v.name] / nbytes[reference[v.side]],
                "peak_mib": max(peak[v.name]) / 2**20, "peak_vs_full": share(max(peak[v.name]), max(peak[reference[v.side]])),
            }  # fmt: skip
            results.append(row)
            rows.append(
                [
                    T, batch, v.name, common.fmt(prefill_ms[v.name]), common.fmt(step_ms[v.name]), f"{tok_s:.1f}",
                    f"{row['vs_full']:.2f}", f"{row['kv_bytes_per_token']:,.0f}", f"{row['kv_vs_full']:.3f}",
                    f"{row['peak_mib']:.0f}", "-" if row["peak_vs_full"] is None else f"{row['peak_vs_full']:.2f}",
                ]
            )  # fmt: skip

    # the windowed model's own forward without a cache, over the prompt and what was generated, picks those tokens
    agree, forwards = {}, {}
    for v in VARIANTS:
        if not v.windowed:
            continue
        use(v)
        key = (v.side, tuple(tokens_of[v.name]))
        if key not in forwards:  # variants of one side that generated the same tokens share the forward
            text = torch.tensor([prompt + tokens_of[v.name][:-1]])
            with torch.no_grad():
                if v.side == "aah":
                    hidden = {}
                    hook = model.blocks[-1].register_forward_hook(lambda m, i, o: hidden.setdefault("x", o))
                    model(text, at=torch.tensor([text.shape[1] - 1]))  # only the last block's output is kept
                    hook.remove()
                    forwards[key] = model.lm_head(model.ln_f(hidden["x"][0, T - 1 :])).argmax(-1).tolist()
                else:
                    forwards[key] = hf(text, use_cache=False, logits_to_keep=n).logits[0].argmax(-1).tolist()
        agree[v.name] = forwards[key] == tokens_of[v.name]
    state["results"] += results
    state["agree"][T] = agree
    state["tables"][T] = {"table": table.tolist(), "sink": sink, "window": width,
                          "acr": float(metrics.acr(table, T, sink))}  # fmt: skip
    same = tokens_of["aah, windows"] == tokens_of["export, windows"]

    for batch in args.batch:
        for side, name in (("aah", "aah, windows"), ("export", "export, windows")):
            row = next(r for r in results if r["batch"] == batch and r["variant"] == name)
            if T == max(args.contexts):
                common.check(f"{side} decode >= 1.5 x full, T={T}, batch {batch}", row["vs_full"], 1.5,
                             f"{row['vs_full']:.2f} x", higher_is_better=True)  # fmt: skip
                common.check(f"{side} KV cache <= 0.3 x full, T={T}, batch {batch}", row["kv_vs_full"], 0.3,
                             f"{row['kv_vs_full']:.3f} x")  # fmt: skip
    for name, ok in agree.items():
        common.check(f"{name}: tokens == its own forward without a cache, T={T}", 0 if ok else 1, 0,
                     "equal" if ok else "differ")  # fmt: skip
    # the same model in two implementations: equal unless a near tie of two tokens falls the other way
    state["same_tokens"][T] = same
    common.check(f"export, windows: tokens == aah, windows, T={T}", 0 if same else 1, 0, "equal" if same else "differ")
    acr = float(metrics.acr(table, T, sink))
    what = (
        f"static table: 1 key/value head in {args.full_every} full, the others sink {sink} + W={width}"
        if args.windows == "static"
        else f"the checkpoint's own table, sink {sink}"
    )
    title = (
        f"context T={T}, {n} new tokens: {cfg.n_layer} layers, {cfg.n_head} heads ({cfg.kv_heads} key/value), "
        f"d={cfg.n_embd}, fp32; {what}; ACR {acr:.3f} at T; tokens equal to the no-cache forward: "
        + ", ".join(f"{k} {'yes' if ok else 'NO'}" for k, ok in state["agree"][T].items())
        + f"; the export's tokens equal aah's: {'yes' if same else 'no'}"
    )
    header = [
        "T", "batch", "variant", "prefill ms (batch 1)", "decode step ms", "tokens/s", "vs full",
        "KV bytes / token", "KV vs full", "peak MiB", "peak vs full",
    ]  # fmt: skip
    return common.md_table(title, header, rows)


def checkpoint_main(args, command: str) -> None:
    from transformers import AutoModelForCausalLM
    from transformers import __version__ as transformers_version
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from aah_lightning.export.exporter import prepare, write

    model, tok = load_model(args.checkpoint)
    table, sink = model.windows.clone(), model.sink
    if args.windows == "checkpoint" and bool((table >= model.cfg.seq_len).all()) and not sink:
        raise SystemExit(f"--windows=checkpoint: {args.checkpoint} has no windows of its own; use --windows static")
    with tempfile.TemporaryDirectory() as folder:  # the export as aah export writes it, loaded as a user loads it
        out = os.path.join(folder, "export")
        write(prepare(args.checkpoint, out=out), out)
        hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    hf.generation_config.eos_token_id = None  # every run decodes --new-tokens steps
    state = {"model": model, "hf": hf, "tok": tok, "table": table, "sink": sink}
    # generate's name for a cache passed in (transformers 5 renamed ``past_key_values`` to ``cache``)
    state["cache_arg"] = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
    state.update(results=[], agree={}, tables={}, same_tokens={})
    now = datetime.datetime.now().isoformat(timespec="minutes")
    versions = f"torch {torch.__version__}, transformers {transformers_version}"
    emit(f"## aah decode benchmark of {os.path.basename(args.checkpoint)}, {now}\n")
    emit(f"command: `{command}`\n\nmachine: {machine(torch.device('cpu'))}; {versions}\n")
    for T in args.contexts:
        try:
            emit(checkpoint_section(T, state, args))
        except ValueError as e:  # a static table the budget cannot hold
            raise SystemExit(f"--acr={args.acr}: {e}") from e
    emit(md_table("targets", ["target", "measured", "verdict"], SUMMARY))
    emit(f"command: `{command}`")
    if args.json:
        record = {
            "command": command,
            "date": now,
            "machine": machine(torch.device("cpu")),
            "versions": {"torch": torch.__version__, "transformers": transformers_version},
            "checkpoint": {"path": args.checkpoint, "sha256": file_sha256(args.checkpoint)},
            "windows": args.windows,
            "new_tokens": args.new_tokens,
            "tables": state["tables"],
            "results": state["results"],
            "tokens_equal": state["agree"],
            "export_tokens_equal_aah": state["same_tokens"],
            "targets": [dict(zip(("target", "measured", "verdict"), row)) for row in SUMMARY],
        }
        atomic_write_text(args.json, json.dumps(record, indent=1) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--contexts", type=int, nargs="+", default=None, help="default 1024 4096; 2048 4096 8192 with --checkpoint"
    )
    p.add_argument("--batch", type=int, nargs="+", default=None, help="default 8; 1 8 with --checkpoint")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="decode steps timed per variant (default 20); decode runs per variant with --checkpoint (default 3)",
    )
    p.add_argument("--prefill-repeats", type=int, default=None, help="default 2; 1 with --checkpoint")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument(
        "--clock",
        default="wall",
        choices=["wall", "cpu"],
        help="wall (default) or process CPU time: with --threads 1 on a busy machine, cpu is the steadier",
    )
    p.add_argument("--checkpoint", default=None, help="an imported or retrofitted checkpoint (aah import, aah fit)")
    p.add_argument(
        "--windows",
        default="static",
        choices=["static", "checkpoint"],
        help="with --checkpoint: a static table at --acr (default), or the checkpoint's own",
    )
    p.add_argument("--acr", type=float, default=0.25, help="--windows static: the ACR at each context (default 0.25)")
    p.add_argument("--sink", type=int, default=4, help="--windows static: the attention sink (default 4)")
    p.add_argument(
        "--full-every",
        type=int,
        default=6,
        help="--windows static: one key/value head in this many sees everything (default 6)",
    )
    p.add_argument(
        "--new-tokens", type=int, default=32, help="with --checkpoint: tokens each decode run generates (default 32)"
    )
    p.add_argument(
        "--json", default=None, help="with --checkpoint: write every number here (aah export --bench reads it)"
    )
    args = p.parse_args(argv)
    ckpt = args.checkpoint is not None
    defaults = {"contexts": [2048, 4096, 8192] if ckpt else [1024, 4096], "batch": [1, 8] if ckpt else [8],
                "repeats": 3 if ckpt else 20, "prefill_repeats": 1 if ckpt else 2}  # fmt: skip
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    for name in ("repeats", "prefill_repeats", "new_tokens", "full_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}: at least 1")
    if ckpt and args.new_tokens < 2:
        p.error(f"--new-tokens={args.new_tokens}: at least 2 (decode steps are the time between two tokens)")
    if ckpt and not os.path.isfile(args.checkpoint):
        p.error(f"--checkpoint={args.checkpoint!r} is not a file: pass a checkpoint of aah import or aah fit")
    use_clock(args.clock)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    if ckpt:
        return checkpoint_main(args, command)
    emit(f"## aah decode benchmark, {datetime.datetime.now().isoformat(timespec='minutes')}\n")
    emit(f"command: `{command}`\n\nmachine: {machine(torch.device('cpu'))}\n")  # after the clock is set
    for T in args.contexts:
        for B in args.batch:
            emit(section(T, B, args))
    emit(md_table("targets", ["target", "measured", "verdict"], SUMMARY))
    emit(f"command: `{command}`")


if __name__ == "__main__":
    main()
