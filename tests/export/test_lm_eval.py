"""The shipped lm-evaluation-harness task: its data, the builder that makes it, and an exported model evaluated on it
offline through lm-eval's own command line, whose log-likelihoods equal the model's own."""

from __future__ import annotations

import glob
import hashlib
import json
import os

import numpy as np
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from aah_lightning.export import next_line_task as task
from helpers.lm_eval import run_lm_eval

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def check_examples(examples: list[dict]) -> None:
    for ex in examples:
        choices, context = ex["choices"], ex["context"]
        assert len(choices) == 4 and len({c.strip() for c in choices}) == 4 and 0 <= ex["label"] < 4
        assert len({task._indent(c) for c in choices}) == 1  # indentation gives nothing away
        assert all(c.endswith("\n") and task._choosable(c) for c in choices)
        assert context.endswith("\n") and len(context.encode()) <= task.MAX_CONTEXT_BYTES
        assert len(context.encode()) + max(len(c.encode()) for c in choices) + 1 <= 256  # fits the quickstart's T


def test_shipped_task_data_is_what_its_metadata_says():
    payload = open(os.path.join(task.TASK_DIR, "data.jsonl"), "rb").read()
    with open(os.path.join(task.TASK_DIR, "meta.json")) as f:
        meta = json.load(f)
    assert hashlib.sha256(payload).hexdigest() == meta["sha256"]
    examples = read_jsonl(os.path.join(task.TASK_DIR, "data.jsonl"))
    assert len(examples) == meta["examples"] == 400 and meta["data"]["source"] == "stdlib"
    check_examples(examples)
    labels = np.bincount([ex["label"] for ex in examples], minlength=4)
    assert labels.min() > 70  # the true line is not always in one place


def python_tokens(*names: str) -> tuple[np.ndarray, str]:
    """Byte tokens of some standard library sources, documents separated by the end-of-document token."""
    import sysconfig

    texts = [open(os.path.join(sysconfig.get_paths()["stdlib"], n), encoding="utf-8").read() for n in names]
    parts = []
    for text in texts:
        parts += [np.frombuffer(text.encode(), np.uint8).astype(np.int64), np.array([task.EOD])]
    return np.concatenate(parts[:-1])[300:], "\n".join(texts)  # start mid-line, as a held-out range may


def test_builder_is_deterministic_and_quotes_the_held_out_text():
    tokens, text = python_tokens("json/decoder.py", "json/encoder.py", "textwrap.py")
    examples = task.build_examples(tokens, 40, seed=3)
    assert len(examples) == 40 and examples == task.build_examples(tokens, 40, seed=3)
    assert examples != task.build_examples(tokens, 40, seed=4)
    check_examples(examples)
    for ex in examples:  # the context and the true line are consecutive lines of a source file
        assert ex["context"] + ex["choices"][ex["label"]] in text
    truth = {ex["context"]: task._continuation(ex["context"], ex["choices"][ex["label"]]) for ex in examples}
    oracle = task.accuracy(examples, lambda context, cont: float(context != "" and cont == truth[context]))
    assert oracle == {"acc": 1.0, "acc_norm": 1.0, "acc_mutual_info": 1.0}
    unigram = task.accuracy(examples, task.unigram_scorer(tokens))
    assert 0.0 <= unigram["acc"] <= 1.0


def test_regenerating_writes_data_and_meta(tmp_path, capsys):
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump({"data": {"source": "stdlib", "seq_len": 256, "max_documents": 60}}))
    assert task.main(["--config", str(config), "--out", str(tmp_path / "task"), "--examples", "30"]) == 0
    out = capsys.readouterr().out
    assert "random choice: 0.2500 for every metric" in out and "unigram (train byte frequencies): acc " in out
    examples = read_jsonl(tmp_path / "task" / "data.jsonl")
    meta = json.loads((tmp_path / "task" / "meta.json").read_text())
    assert len(examples) == meta["examples"] == 30 and meta["data"]["max_documents"] == 60
    check_examples(examples)


def loglikelihood(model, head: list[int], continuation: list[int]) -> float:
    """Sum of log-probabilities of the ``continuation`` tokens after the ``head`` tokens."""
    ids = torch.tensor([head + continuation])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
    return float(logp[torch.arange(len(head) - 1, ids.shape[1] - 1), ids[0, len(head) :]].sum())


def own_scorer(model):
    """``score(context, continuation)`` as lm-eval feeds the export: the tokenizer puts the end-of-document token
    first; an empty context is that token alone (lm-eval's prefix for a context-free score)."""

    def score(context: str, continuation: str) -> float:
        if context == "":
            return loglikelihood(model, [256], list(continuation.encode()))
        return loglikelihood(model, [256] + list(context.rstrip().encode()), list(continuation.encode()))

    return score


@pytest.mark.heavy  # an lm-eval subprocess: ~20 s on an idle 2-core machine
def test_lm_eval_runs_the_export_offline_with_the_models_own_scores(exported, make_module, tmp_path):
    folder = exported(make_module(seed=0, n_layer=2, seq_len=256, noise=0.05), name="for_lm_eval")
    out = tmp_path / "results"
    done = run_lm_eval(folder, out, tmp_path, limit=12)
    assert "aah_python_next_line" in done.stdout and "acc_mutual_info" in done.stdout

    results = json.load(open(glob.glob(str(out / "*" / "results_*.json"))[0]))
    scores = results["results"]["aah_python_next_line"]
    samples = read_jsonl(glob.glob(str(out / "*" / "samples_aah_python_next_line_*.jsonl"))[0])
    assert len(samples) == 12 and results["max_length"] == 256

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    score = own_scorer(model)
    examples = read_jsonl(os.path.join(task.TASK_DIR, "data.jsonl"))[:12]
    for sample in samples:  # conditional scores of the four choices, then the unconditional ones
        ex = examples[sample["doc_id"]]
        theirs = [float(r[0]) for r in sample["filtered_resps"]]
        mine = [score(ex["context"], task._continuation(ex["context"], c)) for c in ex["choices"]]
        mine += [score("", c) for c in ex["choices"]]
        assert np.allclose(theirs, mine, atol=1e-3), (theirs, mine)
    expected = task.accuracy(examples, score)
    assert {k: scores[f"{k},none"] for k in expected} == expected


def test_the_eval_extra_brings_what_the_documented_tasks_need():
    """[eval] installs lm-eval with its Hugging Face backend and its RULER extra, and both are extras the installed
    lm-eval defines (a misspelt one would be silently ignored by pip)."""
    from importlib.metadata import metadata

    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["eval"]
    spec = next(r for r in extra if r.startswith("lm-eval["))
    named = set(spec.split("[", 1)[1].split("]", 1)[0].split(","))
    assert {"hf", "ruler"} <= named
    assert named <= set(metadata("lm_eval").get_all("Provides-Extra"))


def test_rolling_loglikelihood_with_add_bos_token_false_scores_the_document_and_nothing_else(exported, make_module):
    """What the docs say to pass for perplexity tasks: with ``add_bos_token=False`` the harness's rolling
    log-likelihood is the model's own (each text token after the end-of-document token); without it, the
    tokenizer's end-of-document token is scored once more."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    module = make_module(seed=0)
    folder = exported(module)
    text = "def add(a, b):\n    return a + b\n"
    ids = list(text.encode())
    with torch.no_grad():
        logprobs = module.model(torch.tensor([[256, *ids]]))[0].log_softmax(-1)
    own = sum(logprobs[i, token].item() for i, token in enumerate(ids))
    request = [Instance("loglikelihood_rolling", {}, (text,), 0)]
    scores = {}
    for args in ({}, {"add_bos_token": False}):
        lm = HFLM(pretrained=folder, trust_remote_code=True, device="cpu", batch_size=1, **args)
        (scores[bool(args)],) = lm.loglikelihood_rolling(request, disable_tqdm=True)
    assert abs(scores[True] - own) < 1e-3
    assert scores[False] < own - 1.0  # the extra token's log-probability on top
