"""The verdict on a retrofitted pretrained model: window tables at one budget, compared on real text and a passkey.

Rows (``tables``), all at the same budget (ACR, the share of the context each head keeps, sink included):

* ``full``: every head the whole context (the reference, not a row of the budget);
* ``fixed``: one window for every head, no sink;
* ``streaming``: a sink and one window for every head (StreamingLLM);
* ``need``: the controller's decision, the ``retrieval`` signal with the query heads of each key/value head as one
  group (``groups.method: kv_heads``), candidates ``[short, T]``, a sink;
* ``random_<i>``: the same number of long key/value heads as ``need``, drawn at random over the whole model (one
  seeded draw each), every other head as ``need``'s.

With a fine-tune, every row is measured twice: as imported, and as ``<row>+ft`` after ``fine_tune`` under its own
table from the same imported weights; rows are compared only with rows of their own kind (tuned with tuned).

Measures (``evaluate``): per-block loss on held-out text (paired over blocks against ``full``: the sign test and the
paired permutation test) and a passkey suite (a five-digit key in held-out text, asked for at the end; one trial
is correct when every digit is the model's argmax under teacher forcing; the same prompts for every row, so rows are
compared trial by trial with McNemar's exact test). Holm's correction runs over every p-value of the report.
"""

from __future__ import annotations

import math
import random

import torch
import torch.nn.functional as F

from aah_lightning.experiments import stats
from aah_lightning.windows import metrics
from aah_lightning.windows.config import AAHConfig, ControllerConfig
from aah_lightning.windows.policy_base import make_policy

NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = " What is the pass key? The pass key is {key}"
DIGITS = 5


def widest_window(seq_len: int, target: float, sink: int, n_layer: int, n_head: int) -> int:
    """The widest window one window for all can have at ACR ``target`` with ``sink``."""
    best = 1
    for w in range(1, seq_len + 1):
        if float(metrics.acr(torch.full((n_layer, n_head), w), seq_len, sink)) <= target + 1e-12:
            best = w
    return best


def need_table(model, probe_tokens: torch.Tensor, target: float, short: int, sink: int, n_probes: int, span: int):
    """The controller's step-0 table: the ``retrieval`` signal on ``probe_tokens`` ``[n, T]``, key/value-head groups,
    candidates ``[short, T]``, whole-model budget ``target``."""
    n_layer, n_head, n_kv = model.cfg.n_layer, model.cfg.n_head, model.cfg.n_kv_head or model.cfg.n_head
    T = probe_tokens.shape[1]
    controller = ControllerConfig(
        need={"signal": "retrieval", "probe_sequences": n_probes, "copy_span": span, "ema_alpha": 0.0},
        groups={"method": "kv_heads", "kv_heads": n_kv, "depth": 1},
        allocation={"coverage_target": 1.0},
        budget={"target_acr": target, "scope": "model"},
        schedule={"warmup_steps": 0, "control_interval": 1},
    )
    cfg = AAHConfig(policy="adaptive", candidates=[short, T], sink=sink, controller=controller)
    policy = make_policy(cfg, n_layer, n_head, T)
    policy.set_run_length(1)
    model.set_windows(torch.full((n_layer, n_head), T, dtype=torch.int32))
    table = policy.on_train_step(0, model, {"tokens": torch.cat([probe_tokens, probe_tokens[:, -1:]], 1)})
    return table, policy.report().need


def random_tables(table: torch.Tensor, n_kv: int, draws: int, seed: int = 0) -> list[torch.Tensor]:
    """``draws`` tables holding as many long key/value heads as ``table`` (groups of its widest window), each placed
    on key/value heads drawn at random over the whole model; every other group gets ``table``'s narrowest window."""
    L, H = table.shape
    size = H // n_kv
    groups = table.view(L, n_kv, size)[..., 0].flatten()
    long_w, short_w = int(groups.max()), int(groups.min())
    k = int((groups == long_w).sum())
    rng = random.Random(seed)
    out = []
    for _ in range(draws):
        chosen = rng.sample(range(L * n_kv), k)
        g = torch.full((L * n_kv,), short_w, dtype=torch.int32)
        g[chosen] = long_w
        out.append(g.view(L, n_kv, 1).expand(L, n_kv, size).reshape(L, H).clone())
    return out


def passkey_trials(hay: list[int], encode, buckets: list[tuple[int, int]], per_bucket: int, seed: int = 0):
    """``(tokens, bucket, distance)`` per trial: held-out text with a needle ``distance`` tokens before the question
    (distance uniform in the bucket), a random stretch of text before the needle."""
    rng = random.Random(seed)
    trials = []
    for b, (lo, hi) in enumerate(buckets):
        for _ in range(per_bucket):
            key = "".join(str(rng.randrange(10)) for _ in range(DIGITS))
            needle, question = encode(NEEDLE.format(key=key)), encode(QUESTION.format(key=key))
            distance = rng.randrange(lo, hi)
            before = rng.randrange(16, 128)
            filler = distance - len(needle)
            start = rng.randrange(0, len(hay) - before - filler)
            tokens = hay[start : start + before] + needle + hay[start + before : start + before + filler] + question
            trials.append((tokens, b, distance))
    return trials


@torch.no_grad()
def passkey_correct(model, trials) -> list[bool]:
    out = []
    for tokens, _, _ in trials:
        ids = torch.tensor([tokens])
        logits = model(ids)[0, -DIGITS - 1 : -1]
        out.append(bool((logits.argmax(-1) == ids[0, -DIGITS:]).all()))
    return out


@torch.no_grad()
def block_losses(model, blocks: torch.Tensor) -> list[float]:
    """Mean next-token loss of each block ``[n, T + 1]``."""
    out = []
    for row in blocks:
        logits = model(row[None, :-1])
        out.append(float(F.cross_entropy(logits[0].float(), row[1:])))
    return out


FT = "+ft"  # the suffix of a fine-tuned row
PRECISIONS = ("32-true", "bf16-mixed")  # Lightning's names for the tools' two numerics


def autocast(precision: str):
    """The CPU numerics of ``precision``: bfloat16 autocast for ``bf16-mixed`` (weights and optimizer stay float32),
    nothing for ``32-true``."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")


def fine_tune(model, blocks: torch.Tensor, steps: int, lr: float, seed: int = 0) -> list[float]:
    """A short full-model fine-tune under the model's current windows and sink: ``steps`` AdamW steps of one block
    each (``blocks`` ``[n, T + 1]``, taken in a seeded order), the rate warmed up over the first tenth of the steps.
    Returns the training losses. A loop of its own, not a Trainer: every row starts again from the same imported
    weights inside one process, where a run per row would reload the checkpoint and its data each time."""
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = max(1, steps // 10)
    losses = []
    model.train()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warm)
        row = blocks[order[step % len(blocks)]]
        logits = model(row[None, :-1])
        loss = F.cross_entropy(logits[0].float(), row[1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses


def mcnemar(a: list[bool], b: list[bool]) -> float:
    """McNemar's exact test: the two-sided binomial test of the discordant trials."""
    ab = sum(x and not y for x, y in zip(a, b))
    ba = sum(y and not x for x, y in zip(a, b))
    return stats.sign_test([1.0] * ab + [-1.0] * ba) if ab + ba else 1.0


def report(rows: dict, buckets, baselines=("full", "streaming", "fixed"), tested=("need",)) -> str:
    """Markdown: per row the KV kept, perplexity against full as imported (paired test over blocks), passkey accuracy
    per bucket with Clopper-Pearson intervals; then each tested row against each baseline of its own kind, fine-tuned
    or not (McNemar on the trials, the sign and permutation tests on the block losses), with Holm over every p-value
    of the comparisons."""
    full = rows["full"]
    lines = [
        "| row | ACR | KV groups full | perplexity | vs full | "
        + " | ".join(f"passkey {lo}-{hi}" for lo, hi in buckets)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(buckets),
    ]
    for name, r in rows.items():
        ppl = math.exp(sum(r["losses"]) / len(r["losses"]))
        rel = ppl / math.exp(sum(full["losses"]) / len(full["losses"])) - 1
        cells = []
        for b in range(len(buckets)):
            hits = [c for c, (_, bb, _) in zip(r["correct"], r["trials"]) if bb == b]
            lo, hi = stats.clopper_pearson(sum(hits), len(hits))
            cells.append(f"{sum(hits)}/{len(hits)} [{lo:.2f}, {hi:.2f}]")
        lines.append(f"| {name} | {r['acr']:.3f} | {r['long']} | {ppl:.2f} | {rel:+.1%} | " + " | ".join(cells) + " |")
    comparisons, pvalues = [], []

    def kind(n):  # (the row without its suffix, whether it was fine-tuned)
        return (n[: -len(FT)], True) if n.endswith(FT) else (n, False)

    for t in [n for n in rows if any(kind(n)[0].startswith(x) for x in tested)]:
        tuned = kind(t)[1]
        for base in [n for n in rows if n != t and kind(n)[1] == tuned]:
            if not (kind(base)[0] in baselines or kind(base)[0].startswith("random")):
                continue
            a, b = rows[t], rows[base]
            diffs = [x - y for x, y in zip(a["losses"], b["losses"])]
            p = [mcnemar(a["correct"], b["correct"]), stats.sign_test(diffs), stats.paired_permutation_test(diffs)]
            comparisons.append((t, base, sum(a["correct"]), sum(b["correct"]), sum(diffs) / len(diffs)))
            pvalues += p
    adjusted = stats.holm(pvalues) if pvalues else []
    lines += [
        "",
        "| row | against | passkeys | Δ loss (paired mean, nats) | Holm: McNemar / sign / permutation | passkey | loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (t, base, ka, kb, dl) in enumerate(comparisons):
        adj = adjusted[3 * i : 3 * i + 3]
        key = ("better" if ka > kb else "worse") if adj[0] < 0.05 and ka != kb else "not resolved"
        loss = ("lower" if dl < 0 else "higher") if min(adj[1:]) < 0.05 else "not resolved"
        n = len(rows[t]["correct"])
        lines.append(
            f"| {t} | {base} | {ka}/{n} vs {kb}/{n} | {dl:+.4f} | "
            + " / ".join(f"{p:.3g}" for p in adj)
            + f" | {key} | {loss} |"
        )
    return "\n".join(lines) + "\n"


@torch.no_grad()
def answer_logprob(model, trials) -> float:
    """Mean over ``trials`` of the log-probability the model gives the key's digits (teacher forcing): a graded
    passkey score, where ``passkey_correct`` only says all or nothing."""
    total = 0.0
    for tokens, _, _ in trials:
        ids = torch.tensor([tokens])
        logp = F.log_softmax(model(ids)[0, -DIGITS - 1 : -1].float(), dim=-1)
        total += float(logp.gather(1, ids[0, -DIGITS:, None]).sum())
    return total / len(trials)


def passkey_head_scan(model, trials, narrow: int, sink: int, seq_len: int, progress=None) -> dict:
    """Which key/value heads the passkey depends on, one head at a time, both ways:

    * ``gain[l, g]``: the digits' log-probability with every head at ``narrow`` (and the sink) but key/value head
      ``g`` of layer ``l`` at the whole context, minus that with every head at ``narrow``;
    * ``loss[l, g]``: the log-probability with every head whole, minus that with key/value head ``g`` of layer
      ``l`` alone at ``narrow``.

    A whole head's window is ``seq_len`` (at least every trial's length). ``2 * L * n_kv + 2`` passes over
    ``trials``. Returns ``base`` (all narrow), ``full``, ``gain`` and ``loss``
    (``[L, n_kv]`` lists)."""
    L, H = model.cfg.n_layer, model.cfg.n_head
    n_kv = model.cfg.n_kv_head or H
    size = H // n_kv
    T = seq_len
    narrow_all = torch.full((L, H), narrow, dtype=torch.int32)
    whole_all = torch.full((L, H), T, dtype=torch.int32)
    model.sink = sink

    def score(table):
        model.set_windows(table)
        return answer_logprob(model, trials)

    base, full = score(narrow_all), score(whole_all)
    gain = torch.zeros(L, n_kv, dtype=torch.float64)
    loss = torch.zeros(L, n_kv, dtype=torch.float64)
    for layer in range(L):
        for g in range(n_kv):
            heads = slice(g * size, (g + 1) * size)
            widened, narrowed = narrow_all.clone(), whole_all.clone()
            widened[layer, heads], narrowed[layer, heads] = T, narrow
            gain[layer, g] = score(widened) - base
            loss[layer, g] = full - score(narrowed)
        if progress is not None:
            progress(layer)
    return {"base": base, "full": full, "gain": gain.tolist(), "loss": loss.tolist()}
