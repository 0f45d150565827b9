"""``aah_python_next_line``: a small lm-evaluation-harness task built from the embedded corpus' held-out text.

Each example is a few lines of Python source (``context``) and four candidate next lines (``choices``): the line that
really follows, and three lines drawn from elsewhere in the held-out text with the same indentation (so indentation
alone gives nothing away). A model scores each choice by its log-likelihood after the context; ``acc`` counts the
examples where the true line scores highest, ``acc_norm`` the same with scores divided by the line's length in
characters, and ``acc_mutual_info`` with each score minus the line's log-likelihood without the context (how much the
context raised it: the raw scores mostly measure how common a line is). Chance is 1/4.

The text is the quickstart's validation split of the ``stdlib`` corpus (``configs/quickstart.yaml``'s ``data``
settings: the tail of the seeded token stream, never trained on), so the task data is a function of the Python
version whose standard library is the corpus. Regenerate it, and print the random and unigram baselines, with

    python -m aah_lightning.export.next_line_task --config configs/quickstart.yaml --out DIR

The shipped copy (``lm_eval_tasks/aah_python_next_line/data.jsonl`` with ``meta.json``) was built this way.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from aah_lightning.atomic import atomic_write_text

TASK_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lm_eval_tasks", "aah_python_next_line")
EOD = 256  # the byte tokenizer's end-of-document id
CHOICES = 4
MAX_CONTEXT_BYTES = 160  # context + the longest choice + the leading end-of-document token fit in T = 256
MIN_LINE, MAX_LINE = 8, 80  # a choice's length in bytes, without its newline


@dataclass(frozen=True)
class Line:
    piece: int  # which document piece of the held-out text it comes from
    index: int  # its line number in that piece
    text: str  # with its trailing newline


def held_out_pieces(tokens: np.ndarray) -> list[list[str]]:
    """The held-out byte tokens as document pieces (split at end-of-document tokens), each a list of lines that keep
    their newline. A piece's first line is dropped unless the piece starts a document (the held-out range may begin
    mid-line); lines that are not valid UTF-8 are dropped with their neighbours' context (the piece is cut there)."""
    pieces, start_is_document = [], False
    for chunk in np.split(tokens, np.flatnonzero(tokens == EOD)):
        body = chunk[1:] if len(chunk) and chunk[0] == EOD else chunk
        text = body.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        lines = text.splitlines(keepends=True)
        if not start_is_document:
            lines = lines[1:]
        start_is_document = True
        current: list[str] = []
        for line in lines:
            if "\ufffd" in line:
                if current:
                    pieces.append(current)
                current = []
            else:
                current.append(line)
        if current:
            pieces.append(current)
    return pieces


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip(" \t"))]


def _choosable(line: str) -> bool:
    """A complete line (it ends with a newline) of MIN_LINE..MAX_LINE bytes with some code on it."""
    size = len(line.rstrip("\n").encode("utf-8"))
    return line.endswith("\n") and MIN_LINE <= size <= MAX_LINE and bool(line.strip())


def build_examples(tokens: np.ndarray, count: int, seed: int = 0) -> list[dict]:
    """Up to ``count`` examples from held-out byte tokens, deterministically for a given ``seed``.

    Each: ``context`` (whole lines, at most MAX_CONTEXT_BYTES bytes, ending with a newline), ``choices`` (four lines,
    each with its newline) and ``label`` (the index of the true next line)."""
    pieces = held_out_pieces(tokens)
    pool: dict[str, list[Line]] = defaultdict(list)  # distractor candidates by indentation
    targets: list[Line] = []
    for p, lines in enumerate(pieces):
        for i, line in enumerate(lines):
            if _choosable(line):
                pool[_indent(line)].append(Line(p, i, line))
                if i >= 1:
                    targets.append(Line(p, i, line))
    rng = random.Random(seed)
    rng.shuffle(targets)
    examples = []
    for target in targets:
        if len(examples) == count:
            break
        lines = pieces[target.piece]
        context, size = [], 0
        for line in reversed(lines[: target.index]):
            size += len(line.encode("utf-8"))
            if size > MAX_CONTEXT_BYTES:
                break
            context.insert(0, line)
        if not context or not "".join(context).strip():
            continue
        seen = {target.text.strip()}
        distractors = []
        candidates = pool[_indent(target.text)]
        for _ in range(50):  # draws; an indentation with few distinct lines yields no example
            if len(distractors) == CHOICES - 1:
                break
            other = candidates[rng.randrange(len(candidates))]
            if other.piece != target.piece and other.text.strip() not in seen:
                seen.add(other.text.strip())
                distractors.append(other.text)
        if len(distractors) < CHOICES - 1:
            continue
        label = rng.randrange(CHOICES)
        choices = distractors[:label] + [target.text] + distractors[label:]
        examples.append({"context": "".join(context), "choices": choices, "label": label})
    return examples


# -- scoring without a model: the baselines ----------------------------------------------------------------------
def _continuation(context: str, choice: str) -> str:
    """What lm-evaluation-harness scores: it moves the context's trailing whitespace into each continuation."""
    stripped = context.rstrip()
    return context[len(stripped) :] + choice


def accuracy(examples: list[dict], score) -> dict[str, float]:
    """``acc``, ``acc_norm`` and ``acc_mutual_info`` as lm-evaluation-harness computes them for multiple choice, from
    ``score(context, continuation)`` = the log-likelihood of the continuation after the context (``""``: no context).
    The first highest score wins a tie."""
    hits = {"acc": 0, "acc_norm": 0, "acc_mutual_info": 0}
    for ex in examples:
        lls = np.array([score(ex["context"], _continuation(ex["context"], c)) for c in ex["choices"]])
        lengths = np.array([float(len(c)) for c in ex["choices"]])
        unconditional = np.array([score("", c) for c in ex["choices"]])
        hits["acc"] += int(np.argmax(lls)) == ex["label"]
        hits["acc_norm"] += int(np.argmax(lls / lengths)) == ex["label"]
        hits["acc_mutual_info"] += int(np.argmax(lls - unconditional)) == ex["label"]
    return {name: n / len(examples) for name, n in hits.items()}


def unigram_scorer(train_tokens: np.ndarray):
    """Log-likelihood of a text's bytes under byte frequencies of the training tokens (add-one smoothing): the best a
    model can do without context."""
    counts = np.bincount(train_tokens.reshape(-1), minlength=EOD + 1).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())

    def score(context: str, continuation: str) -> float:
        return float(logp[np.frombuffer(continuation.encode("utf-8"), dtype=np.uint8)].sum())

    return score


# -- the data of the quickstart's held-out split -----------------------------------------------------------------
def quickstart_split(config: str):
    """Training and held-out (validation) byte tokens of a config's data settings (its ``data`` section)."""
    import yaml

    from aah_lightning.errors import ConfigError
    from aah_lightning.lit.datamodule import TextDataModule

    with open(config) as f:
        data = (yaml.safe_load(f) or {}).get("data", {})
    if data.get("source", "stdlib") not in ("stdlib", "files") or data.get("tokenizer", "byte") != "byte":
        raise ConfigError(f"{config}: the task is built from byte-tokenized text (data.source stdlib or files)")
    dm = TextDataModule(**data)
    dm.setup("fit")
    held_out = dm.val_set.as_array().reshape(-1)  # consecutive blocks: one stretch of the token stream
    return dm.train_set.as_array()[:, 1:], held_out.astype(np.int64), data


def write_task_data(examples: list[dict], out: str, meta: dict) -> None:
    os.makedirs(out, exist_ok=True)
    payload = "".join(json.dumps(ex, ensure_ascii=False) + "\n" for ex in examples)
    atomic_write_text(os.path.join(out, "data.jsonl"), payload)
    meta = {**meta, "examples": len(examples), "sha256": hashlib.sha256(payload.encode("utf-8")).hexdigest()}
    atomic_write_text(os.path.join(out, "meta.json"), json.dumps(meta, indent=2) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/quickstart.yaml", help="whose data settings define the held-out text")
    p.add_argument("--out", default=None, help="write data.jsonl and meta.json here (default: only print baselines)")
    p.add_argument("--examples", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    train, held_out, data = quickstart_split(args.config)
    examples = build_examples(held_out, args.examples, args.seed)
    meta = {
        "task": "aah_python_next_line",
        "config": os.path.basename(args.config),
        "data": data,
        "python": ".".join(map(str, sys.version_info[:3])),
        "held_out_tokens": int(held_out.size),
        "seed": args.seed,
        "choices": CHOICES,
    }
    if args.out:
        write_task_data(examples, args.out, meta)
        print(f"wrote {len(examples)} examples to {os.path.join(args.out, 'data.jsonl')}")
    unigram = accuracy(examples, unigram_scorer(train))
    print(f"examples {len(examples)} from {held_out.size} held-out tokens (Python {meta['python']})")
    print(f"random choice: {1 / CHOICES:.4f} for every metric (expected)")
    print(
        f"unigram (train byte frequencies): acc {unigram['acc']:.4f}, acc_norm {unigram['acc_norm']:.4f}, "
        f"acc_mutual_info {unigram['acc_mutual_info']:.4f} (no context: always the first choice)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
