"""The model card (README.md) of an export: what was trained, its window table, how to load and evaluate it."""

from __future__ import annotations

import json
import os
from collections import Counter

import torch

from aah_lightning.checkpoint import GLOBAL_STEP_KEY, hyperparameters
from aah_lightning.model.config import GPTConfig
from aah_lightning.windows import metrics

# Data settings worth a reader's time (the rest are paths, worker counts and cache folders).
_DATA_KEYS = ("source", "tokenizer", "seq_len", "batch_size", "paths", "path", "hub_name", "hub_config", "seed")


def window_summary(windows: torch.Tensor, seq_len: int) -> list[str]:
    """Markdown lines: ACR, causal coverage, the window histogram and the table itself."""
    table = windows.to(torch.int64)
    acr = float(metrics.acr(table, seq_len))
    coverage = float(metrics.causal_coverage(table, seq_len))
    counts = Counter(int(w) for w in table.flatten().tolist())
    n = table.numel()
    lines = [
        f"- ACR (mean over heads of min(W, T) / T, T = {seq_len}): **{acr:.3f}**",
        f"- causal coverage (in-window causal pairs / all causal pairs): **{coverage:.3f}**",
        "- windows: " + ", ".join(f"W={w}: {c} of {n} heads" for w, c in sorted(counts.items())),
        "",
        "| layer | " + " | ".join(f"head {h}" for h in range(table.shape[1])) + " | ACR | causal coverage |",
        "|---" * (table.shape[1] + 3) + "|",
    ]
    for layer, row in enumerate(table):
        cells = " | ".join(str(int(w)) for w in row)
        lines.append(
            f"| {layer} | {cells} | {float(metrics.acr(row, seq_len)):.3f} | "
            f"{float(metrics.causal_coverage(row, seq_len)):.3f} |"
        )
    return lines


def render(ckpt_path: str, ckpt: dict, gpt: GPTConfig, windows: torch.Tensor, tok, data: dict, params: int) -> str:
    """The card's markdown; ``params``: the exported model's parameter count."""
    training = {"model": hyperparameters(ckpt), "data": {k: data[k] for k in _DATA_KEYS if data.get(k) is not None}}
    step = ckpt.get(GLOBAL_STEP_KEY)
    tokenizer = (
        "none (trained on synthetic data): pass token ids"
        if tok is None
        else f"`{tok.spec}`; end-of-document token `{tok.eod}` = id {tok.eod_id}"
    )
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "tags: [aah, custom_code, per-head-attention-windows]",
        "---",
        "",
        f"# aah GPT: {gpt.n_layer} layers x {gpt.n_head} heads, d = {gpt.n_embd}",
        "",
        "A GPT trained with aah (Asymmetric Attention Heads): **every attention head has its own causal window**. "
        "Query i of head h in layer l attends to key j iff `0 <= i - j < windows[l][h]`; the table is `windows` in "
        "config.json and the modeling code (`modeling_aah.py`) applies it exactly.",
        "",
        f"- exported from `{os.path.basename(ckpt_path)}`" + (f" at optimizer step {step}" if step is not None else ""),
        f"- about {params / 1e6:.2f} M parameters; trained sequence length T = {gpt.seq_len} "
        f"(`max_position_embeddings`); vocabulary {gpt.vocab_size}",
        f"- tokenizer: {tokenizer}",
        "",
        "## Window table",
        "",
        *window_summary(windows, gpt.seq_len),
        "",
        "## Load",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("PATH", trust_remote_code=True)',
        'tokenizer = AutoTokenizer.from_pretrained("PATH")',
        'ids = tokenizer("def fib(", return_tensors="pt").input_ids  # starts with the end-of-document token',
        "out = model.generate(ids, max_new_tokens=64, do_sample=False)",
        "print(tokenizer.decode(out[0], skip_special_tokens=True))",
        "```",
        "",
        "Evaluate with lm-evaluation-harness: `lm_eval --model hf --model_args pretrained=PATH,trust_remote_code=True "
        "--tasks <task>`.",
        "",
        "## Notes",
        "",
        "- The tokenizer puts the end-of-document token first when it adds special tokens (the default): the model was "
        "trained on documents that each follow one. `add_special_tokens=False` gives the text's plain tokens.",
        "- The key/value cache keeps every past position (the windows are applied by the mask), so it uses as much "
        "memory as a model without windows.",
        "- Beyond T tokens the table still holds: heads with W = T slide at T.",
    ]
    if gpt.document_mask:
        lines.append(
            "- Trained with document masking; the export does not mask across documents: give it one document at a "
            "time."
        )
    lines += ["", "## Training configuration", "", "```json", json.dumps(training, indent=2, default=str), "```", ""]
    return "\n".join(lines)
