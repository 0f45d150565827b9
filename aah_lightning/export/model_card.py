"""The model card (README.md) of an export: what was trained, its window table, how to load and evaluate it."""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass

import torch

from aah_lightning.checkpoint import CALLBACKS_KEY, DATAMODULE_STATE_KEY, GLOBAL_STEP_KEY, hyperparameters
from aah_lightning.errors import ConfigError
from aah_lightning.model import generate
from aah_lightning.model.config import GPTConfig
from aah_lightning.windows import metrics

LICENSE = "apache-2.0"  # aah's (pyproject.toml), which the modeling code in the folder is under

# Data settings worth a reader's time (the rest are paths, worker counts and cache folders).
_DATA_KEYS = ("source", "tokenizer", "seq_len", "batch_size", "seed")


def data_summary(data: dict) -> dict:
    """The card's data settings: the shared ones, the chosen source's own block (``data.files``, ``data.hub``, ...), and
    the recall block where recall blocks were mixed in."""
    summary = {k: data[k] for k in _DATA_KEYS if data.get(k) is not None}
    source = data.get("source")
    if isinstance(data.get(source), dict):
        summary[source] = data[source]
    recall = data.get("recall") or {}
    if source != "recall" and recall.get("fraction"):
        summary["recall"] = recall
    return summary


def window_summary(windows: torch.Tensor, seq_len: int, sink: int = 0) -> list[str]:
    """Markdown lines: ACR, causal coverage (both with the sink's pairs), the window histogram and the table itself."""
    table = windows.to(torch.int64)
    acr = float(metrics.acr(table, seq_len, sink))
    coverage = float(metrics.causal_coverage(table, seq_len, sink))
    counts = Counter(int(w) for w in table.flatten().tolist())
    n = table.numel()
    with_sink = " plus the sink's pairs / T^2" if sink else ""
    lines = [
        f"- ACR (mean over heads of min(W, T) / T{with_sink}, T = {seq_len}): **{acr:.3f}**",
        f"- causal coverage (in-window causal pairs / all causal pairs): **{coverage:.3f}**",
        "- windows: " + ", ".join(f"W={w}: {c} of {n} heads" for w, c in sorted(counts.items())),
        *([f"- attention sink: the first {sink} positions stay visible to every head"] if sink else []),
        "",
        "| layer | " + " | ".join(f"head {h}" for h in range(table.shape[1])) + " | ACR | causal coverage |",
        "|---" * (table.shape[1] + 3) + "|",
    ]
    for layer, row in enumerate(table):
        cells = " | ".join(str(int(w)) for w in row)
        lines.append(
            f"| {layer} | {cells} | {float(metrics.acr(row, seq_len, sink)):.3f} | "
            f"{float(metrics.causal_coverage(row, seq_len, sink)):.3f} |"
        )
    return lines


@dataclass(frozen=True)
class KVSaving:
    """Key/value-cache bytes per token of context at ``context`` tokens: aah's window cache (``generate.cache_bytes``,
    what ``WindowKVCache`` allocates: each key/value head keeps ``min(sink + W, context)`` positions for the widest
    window ``W`` of its query heads and the attention sink) against a cache of every position (``generate.full_cache_bytes``), both with the model's
    own key/value heads."""

    context: int
    dtype: torch.dtype
    window: float
    full: float

    @property
    def kept(self) -> float:
        return self.window / self.full

    @property
    def saving(self) -> float:
        return 1.0 - self.kept


def kv_saving(windows: torch.Tensor, gpt: GPTConfig, dtype: torch.dtype = torch.float32, sink: int = 0) -> KVSaving:
    """The window table's KV cache per token at the trained context ``gpt.seq_len``, in ``dtype`` (with ``sink``
    positions more per windowed key/value head)."""
    T, D, kv = gpt.seq_len, gpt.head_dim, gpt.kv_heads
    window = generate.cache_bytes(windows.tolist(), T, D, dtype=dtype, n_kv_head=kv, sink=sink)
    full = generate.full_cache_bytes(gpt.n_layer, kv, T, D, dtype=dtype)
    return KVSaving(T, dtype, window / T, full / T)


def kv_lines(windows: torch.Tensor, gpt: GPTConfig, dtype: torch.dtype, sink: int = 0) -> list[str]:
    """Markdown lines: the KV cache the windows (and the sink) need against full attention."""
    kv = kv_saving(windows, gpt, dtype, sink)
    kind = str(dtype).removeprefix("torch.")
    groups = (
        f"{gpt.kv_heads} key/value heads for {gpt.n_head} query heads: each keeps the widest window of its group"
        if gpt.kv_heads != gpt.n_head
        else "one key/value head per query head"
    )
    if sink:
        groups += f", plus the {sink} sink positions per windowed key/value head"
    return [
        f"- KV cache per token of context at T = {kv.context} ({kind}, {groups}): **{kv.window:,.0f} B** with the "
        f"windows against **{kv.full:,.0f} B** for full attention: **{kv.kept:.3f}** of it kept, "
        f"a saving of **{100 * kv.saving:.1f} %**",
        "- that is what this folder's transformers model allocates in `generate` (its default cache, "
        "`AAHWindowCache`), as aah's own generation does (`tools/generate.py`, `aah predict`); a `DynamicCache` "
        "passed in keeps every position, the full-attention figure",
    ]


def file_sha256(path: str) -> str:
    """The SHA-256 of a file: what ties a benchmark record to the checkpoint it measured."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


# What the card reads of each row of a benchmark record.
_BENCH_KEYS = ("context", "batch", "variant", "tokens_per_s", "vs_full", "kv_vs_full", "peak_vs_full")


def read_bench(path: str, ckpt_path: str, setting: str = "--bench") -> dict:
    """The record of ``tools/bench_decode.py --json`` for the card, checked to be a measurement of this very model: the
    checkpoint file's SHA-256, and its own windows and sink (``--windows checkpoint``). Raises ``ConfigError``."""
    where = f"{setting}={path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        sha, windows = record["checkpoint"]["sha256"], record["windows"]
        cells = {(r["context"], r["batch"], r["variant"]) for r in record["results"] if set(_BENCH_KEYS) <= set(r)}
        ok = len(cells) == len(record["results"]) > 0 and all(
            (c, b, v) in cells for c, b, _ in cells for v in ("export, windows", "export, full", "aah, windows")
        )
        if not ok or not all(k in record for k in ("command", "date", "machine", "versions", "new_tokens")):
            raise KeyError(path)
    except OSError as e:
        raise ConfigError(f"{where} cannot be read ({e.strerror or e})") from e
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"{where} is not a record of tools/bench_decode.py --checkpoint ... --json") from e
    if sha != file_sha256(ckpt_path):
        raise ConfigError(
            f"{where} measured another checkpoint than --ckpt_path={ckpt_path!r} (its SHA-256 differs): run "
            f"tools/bench_decode.py --checkpoint on this one"
        )
    if windows != "checkpoint":
        raise ConfigError(
            f"{where} measured windows of its own ({windows}), not the checkpoint's: run tools/bench_decode.py "
            f"--checkpoint {ckpt_path} --windows checkpoint --json ..."
        )
    return record


def bench_lines(record: dict) -> list[str]:
    """Markdown lines: the decoding measured on this model (``read_bench``): transformers ``generate`` with the
    window cache against the same weights with full attention, per context and batch, aah's own ratio beside it."""
    rows = {(r["context"], r["batch"], r["variant"]): r for r in record["results"]}
    lines = [
        f"Measured on this model (its weights, windows and sink) by `tools/bench_decode.py`, {record['date']}: "
        f"{record['machine']}; torch {record['versions']['torch']}, transformers "
        f"{record['versions']['transformers']}. Greedy decoding of {record['new_tokens']} tokens after a prompt of "
        "T tokens of text, one prompt's cache repeated to the batch; transformers `generate` with this folder's "
        "window cache against the same weights with full attention in a `DynamicCache`, and aah's own decoding "
        "likewise (tokens/s: the median decode step).",
        "",
        "| T | batch | tokens/s, windows | tokens/s, full attention | decoding vs full | KV cache vs full | "
        "peak memory vs full | aah's decoding vs full |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for context, batch in sorted({(c, b) for c, b, _ in rows}):
        ours, full = rows[context, batch, "export, windows"], rows[context, batch, "export, full"]
        peak = "-" if ours["peak_vs_full"] is None else f"{ours['peak_vs_full']:.2f} x"
        lines.append(
            f"| {context} | {batch} | {ours['tokens_per_s']:.1f} | {full['tokens_per_s']:.1f} | "
            f"**{ours['vs_full']:.2f} x** | {ours['kv_vs_full']:.3f} x | {peak} | "
            f"{rows[context, batch, 'aah, windows']['vs_full']:.2f} x |"
        )
    return [*lines, "", f"command: `{record['command']}`"]


def architecture(gpt: GPTConfig) -> str:
    """The model's settings in a phrase (attention, MLP, norm, output layer, RoPE)."""
    kv = gpt.kv_heads
    attention = (
        f"{gpt.n_head} query heads of size {gpt.head_dim}"
        + (
            f", {kv} key/value head{'s' if kv > 1 else ''} (grouped-query attention)"
            if kv != gpt.n_head
            else ", one key/value head each"
        )
        + (", q/k norm" if gpt.qk_norm else "")
        + (", q/k/v biases" if gpt.qkv_bias and not gpt.bias else "")
    )
    mlp = f"{'SwiGLU' if gpt.mlp == 'swiglu' else 'GELU'} MLP of width {gpt.mlp_width}"
    norm = f"{'RMSNorm' if gpt.norm == 'rmsnorm' else 'LayerNorm'} (eps {gpt.norm_eps:g})"
    head = "output layer tied to the embedding" if gpt.tie_embeddings else "untied output layer"
    rope = f"RoPE base {gpt.rope_base:g}" + (
        f", {gpt.rope_scaling} scaling x{gpt.rope_factor:g}" if gpt.rope_scaling != "none" else ""
    )
    return "; ".join((attention, mlp, norm, head, rope))


def best_scores(ckpt: dict) -> dict[str, float]:
    """The best value of each metric a ModelCheckpoint monitored in this run (``best_checkpoint``: val/loss)."""
    scores = {}
    for state in (ckpt.get(CALLBACKS_KEY) or {}).values():
        if isinstance(state, dict) and state.get("monitor") and state.get("best_model_score") is not None:
            scores[state["monitor"]] = float(state["best_model_score"])
    return scores


def tokens_seen(ckpt: dict, seq_len: int) -> int | None:
    """Training tokens: optimizer steps x global batch x T, when the checkpoint records the data layout."""
    layout = (ckpt.get(DATAMODULE_STATE_KEY) or {}).get("layout")
    step = ckpt.get(GLOBAL_STEP_KEY)
    if not layout or step is None:
        return None
    return int(step) * layout["batch_size"] * layout["world_size"] * layout["accumulate_grad_batches"] * seq_len


def snippet(path: str, tok) -> list[str]:
    """Loading and greedy generation, runnable as written on transformers 4.5x and 5.x (``trust_remote_code`` for the
    tokenizer too: transformers 5 otherwise asks on the terminal, because the folder's config.json names custom
    code)."""
    lines = [
        "```python",
        *(["import torch"] if tok is None else []),
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f"model = AutoModelForCausalLM.from_pretrained({path!r}, trust_remote_code=True)",
    ]
    if tok is None:
        lines += [
            "ids = torch.tensor([[0, 1, 2]])  # no tokenizer (a model of token ids)",
            "out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)",
            "print(out[0].tolist())",
        ]
    else:
        lines += [
            f"tokenizer = AutoTokenizer.from_pretrained({path!r}, trust_remote_code=True)",
            'inputs = tokenizer("def fib(", return_tensors="pt")  # starts with the end-of-document token',
            "out = model.generate(**inputs, max_new_tokens=64, do_sample=False)",
            "print(tokenizer.decode(out[0], skip_special_tokens=True))",
        ]
    return [*lines, "```"]


def render(
    ckpt_path: str,
    ckpt: dict,
    gpt: GPTConfig,
    windows: torch.Tensor,
    tok,
    data: dict,
    params: int,
    path: str = "PATH",
    dtype: torch.dtype = torch.float32,
    sink: int = 0,
    bench: dict | None = None,
) -> str:
    """The card's markdown; ``params``: the exported model's parameter count; ``path``: the export folder, as the
    snippet loads it; ``dtype``: the weights' (and so the cache's) dtype; ``sink``: the model's attention sink;
    ``bench``: a decoding benchmark of this model (``read_bench``), stated in a section of its own."""
    training = {"model": hyperparameters(ckpt), "data": data_summary(data)}
    step = ckpt.get(GLOBAL_STEP_KEY)
    source = data.get("source", "?")
    tokenizer = (
        f"none (trained on {source} data): pass token ids"
        if tok is None
        else f"`{tok.spec}`; end-of-document token `{tok.eod}` = id {tok.eod_id}"
    )
    where = data.get("hub_name") or data.get("paths") or data.get("path")
    seen = tokens_seen(ckpt, gpt.seq_len)
    scores = best_scores(ckpt)
    metric_lines = [f"- best `{name}` during training: **{value:.4f}**" for name, value in sorted(scores.items())]
    if not metric_lines:
        metric_lines = ["- no validation metric is recorded in the checkpoint"]
    lines = [
        "---",
        f"license: {LICENSE}",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [aah, custom_code, per-head-attention-windows]",
        "---",
        "",
        f"# aah GPT: {gpt.n_layer} layers x {gpt.n_head} heads, d = {gpt.n_embd}",
        "",
        f"Architecture: {architecture(gpt)}.",
        "",
        "A GPT trained with aah (Asymmetric Attention Heads): **every attention head has its own causal window**. "
        "Query i of head h in layer l attends to key j iff `0 <= i - j < windows[l][h]`"
        + (f" or `j < {sink}` (the attention sink, `sink` in config.json)" if sink else "")
        + "; the table is `windows` in config.json and the modeling code (`modeling_aah.py`) applies it exactly.",
        "",
        f"- exported from `{os.path.basename(ckpt_path)}`" + (f" at optimizer step {step}" if step is not None else ""),
        f"- about {params / 1e6:.2f} M parameters; trained sequence length T = {gpt.seq_len} "
        f"(`max_position_embeddings`); vocabulary {gpt.vocab_size}",
        f"- tokenizer: {tokenizer}",
        f"- license: {LICENSE} (aah's and the modeling code's); the weights also carry the terms of their training "
        "data",
        "",
        "## Training data",
        "",
        f"- `data.source: {source}`" + (f" ({where})" if where else ""),
        f"- {seen:,} training tokens ({step} optimizer steps)" if seen is not None else "- training tokens: unknown",
        "",
        "## Metrics",
        "",
        *metric_lines,
        "",
        "## Window table",
        "",
        *window_summary(windows, gpt.seq_len, sink),
        "",
        *kv_lines(windows, gpt, dtype, sink),
        "",
        *(["## Measured decoding", "", *bench_lines(bench), ""] if bench else []),
        "## Load",
        "",
        *snippet(path, tok),
        "",
        "Evaluate with lm-evaluation-harness: `lm_eval --model hf --model_args "
        f"pretrained={path},trust_remote_code=True --tasks <task>`; for rolling log-likelihood (perplexity) tasks "
        "such as `wikitext`, add `add_bos_token=False` to the model args: the harness puts the end-of-document token "
        "before each document itself, and with the tokenizer's own it would score that token once more per document.",
        "",
        "## Limitations",
        "",
        "- A research model of aah's experiments: small, trained briefly on the data above, not instruction-tuned or "
        "safety-tuned; it continues text and makes things up.",
        "- The tokenizer puts the end-of-document token first when it adds special tokens (the default): the model was "
        "trained on documents that each follow one. `add_special_tokens=False` gives the text's plain tokens.",
        "- The key/value cache of `generate` (`AAHWindowCache`) keeps per key/value head the sink positions and its "
        'widest window, the figure above; a `DynamicCache` passed in (or `cache_implementation="dynamic"`) keeps '
        'every position; fixed-size caches (`cache_implementation="static"`, `"sliding_window"`) are refused.',
        f"- Prompts longer than T = {gpt.seq_len}: this model reads them whole (the table still holds past T: heads "
        f"with W = T slide at T), while aah's own generation keeps their last T tokens. For aah's behaviour, pass "
        f"`ids[:, -{gpt.seq_len}:]`.",
        "- `attn_implementation` is `sdpa` (default) or `eager`; `output_attentions=True` computes the weights the "
        "eager way.",
    ]
    if gpt.document_mask:
        lines.append(
            "- Trained with document masking; the export does not mask across documents: give it one document at a "
            "time."
        )
    lines += ["", "## Training configuration", "", "```json", json.dumps(training, indent=2, default=str), "```", ""]
    return "\n".join(lines)
