"""``aah export`` of Llama-family models (grouped-query attention, SwiGLU, RMSNorm, untied output layer, q/k norm, q/k/v
biases, RoPE scaling) with their per-head windows: transformers computes aah's logits and greedy text; the model card
states the windows' ACR and the KV cache they save; and the whole way from a Hugging Face folder: ``aah import``, a
retrofit (``model.init_from``, windows decided at step 0), ``aah export``, lm-eval on the shipped task."""

from __future__ import annotations

import glob
import json
import os
import sysconfig

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from aah_lightning import checkpoint as ck
from aah_lightning.cli import main
from aah_lightning.export import model_card
from aah_lightning.export import next_line_task as task
from aah_lightning.export.tokenizer import byte_level_tokenizer
from aah_lightning.lit.module import AAHModule
from aah_lightning.model import generate as gen
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.window_math import kv_group_windows
from helpers.cli import REPO
from helpers.hf_models import save_tiny, save_tokenizer
from helpers.lm_eval import run_lm_eval

# Llama 3-like: 2 key/value heads for 4 query heads, SwiGLU, RMSNorm, untied output, q/k/v biases, llama3 RoPE scaling.
GQA = dict(
    n_kv_head=2,
    mlp="swiglu",
    mlp_hidden=48,
    norm="rmsnorm",
    norm_eps=1e-6,
    tie_embeddings=False,
    qkv_bias=True,
    rope_base=500000.0,
    rope_scaling="llama3",
    rope_factor=4.0,
    rope_original_seq_len=16,
)
# Qwen3-like: q/k norm, head size 16 at width 32, one key/value head (multi-query), tied output, linear scaling.
QK_NORM = dict(
    n_kv_head=1,
    head_size=16,
    qk_norm=True,
    mlp="swiglu",
    norm="rmsnorm",
    rope_scaling="linear",
    rope_factor=2.0,
)
CONFIGS = {"gqa_swiglu_rmsnorm_untied": GQA, "qk_norm_mqa": QK_NORM}
PROMPTS = [
    "def fib(n):\n    ",
    "import os\nimport sys\n\n\nclass Reader:\n    def __init__(self, path):\n        self.p",
]


def llama_module(settings: dict, seed: int = 0, seq_len: int = 64, table=None, noise: float = 0.3) -> AAHModule:
    """A tiny byte-vocabulary Llama-family model with random windows per head (1 and full among them) and weights
    pushed away from their initialisation (norms at 1, biases at 0 would hide a wrong mapping)."""
    torch.manual_seed(seed)
    gpt = GPTConfig(n_layer=3, n_head=4, n_embd=32, seq_len=seq_len, vocab_size=257, **settings)
    module = AAHModule(gpt=gpt)
    if table is None:
        g = torch.Generator().manual_seed(seed + 1)
        table = torch.randint(1, seq_len + 9, (3, 4), generator=g, dtype=torch.int32)
        table[0, 0], table[-1, -1] = 1, seq_len
    module.model.set_windows(table)
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(torch.randn_like(p) * noise)
    return module.eval()


def exit_code(args) -> int:
    with pytest.raises(SystemExit) as done:
        main(args)
    return done.value.code


def load(folder: str):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_and_the_cache_equal_aah_with_random_windows(exported, name):
    settings = CONFIGS[name]
    module = llama_module(settings, seed=0)
    folder = exported(module, name=name)
    hf = load(folder)
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    cfg = module.gpt_config
    assert (config["num_key_value_heads"], config["head_dim"], config["mlp"], config["norm"]) == (
        cfg.kv_heads,
        cfg.head_dim,
        "swiglu",
        "rmsnorm",
    )
    assert config["windows"] == module.model.windows.tolist() and config["tie_word_embeddings"] == cfg.tie_embeddings
    stored = load_file(os.path.join(folder, "model.safetensors"))
    assert ("lm_head.weight" in stored) == (not cfg.tie_embeddings)  # untied: its own weight; tied: stored once
    assert stored["model.blocks.0.attn.qkv.weight"].shape[0] == (4 + 2 * cfg.kv_heads) * cfg.head_dim

    ids = torch.randint(0, 257, (3, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = hf(ids).logits
        for backend in ("sdpa", "auto"):
            assert (got - module.model(ids, backend=backend)).abs().max().item() <= 1e-4, backend
        eager = load(folder)
        eager.config._attn_implementation = "eager"
        assert (eager(ids).logits - got).abs().max().item() <= 1e-4
        # The windows matter: the same weights with every window full give other logits.
        full = llama_module(settings, seed=0, table=torch.full((3, 4), 64)).model(ids)
        assert (full - got).abs().max().item() > 1e-2
        # Incremental decoding past the trained T through a cache of key/value heads equals one forward pass.
        longer = torch.randint(0, 257, (2, 90), generator=torch.Generator().manual_seed(1))
        whole = hf(longer, use_cache=False).logits
        cache = DynamicCache()
        parts = [hf(longer[:, a:b], past_key_values=cache).logits for a, b in ((0, 37), (37, 38), (38, 90))]
        assert (torch.cat(parts, 1) - whole).abs().max().item() <= 1e-4
        assert (whole - module.model(longer, backend="sdpa")).abs().max().item() <= 1e-4
    keys = cache.layers[0].keys if hasattr(cache, "layers") else cache.key_cache[0]
    assert keys.shape[1] == cfg.kv_heads  # the cache holds key/value heads, not one per query head


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_generate_equals_aah_generation(exported, name):
    module = llama_module(CONFIGS[name], seed=2)
    folder = exported(module, name=name)
    hf, tok = load(folder), AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    want = gen.generate(module.model, prompts, gen.GenerationConfig(max_new_tokens=50, temperature=0.0), eod_id=256)
    for prompt, w in zip(prompts, want):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=50, do_sample=False)[0, len(prompt) :].tolist()
        assert len(set(out)) > 5  # varied text, not one repeated token
        assert out[: len(w.tokens)] == w.tokens
        assert (w.stop, out[len(w.tokens) :]) in (("length", []), ("eod", [256]))
    batch = tok(PROMPTS, return_tensors="pt", padding=True)  # left padding generates the same continuations
    out = hf.generate(**batch, max_new_tokens=50, do_sample=False)[:, batch.input_ids.shape[1] :]
    for row, w in zip(out.tolist(), want):
        assert row[: len(w.tokens)] == w.tokens


# -- the model card: ACR and the KV cache ------------------------------------------------------------------------------
KV_TABLE = [[4, 8, 64, 16], [64, 4, 4, 4]]


def test_the_kv_saving_is_the_window_caches_bytes_computed_by_hand():
    """2 layers x 4 query heads, head size 8, T = 64, fp32 (4 bytes), keys and values (2):
    MHA keeps 4+8+64+16 + 64+4+4+4 = 168 positions per token-of-context over 64 -> 168 x 8 x 2 x 4 / 64 = 168 B
    against 8 heads x 8 x 2 x 4 = 512 B; with 2 key/value heads each keeps its group's widest window,
    max(4, 8) + max(64, 16) + max(64, 4) + max(4, 4) = 140 -> 140 B against 256 B; bf16 halves both."""
    for n_kv, window, full in ((None, 168, 512), (2, 140, 256), (1, 128, 128)):
        gpt = GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=64, n_kv_head=n_kv)
        kv = model_card.kv_saving(torch.tensor(KV_TABLE), gpt)
        assert (kv.window, kv.full) == (window, full)
        assert kv.kept == window / full and abs(kv.saving - (1 - window / full)) < 1e-12
        half = model_card.kv_saving(torch.tensor(KV_TABLE), gpt, torch.bfloat16)
        assert (half.window, half.full) == (window / 2, full / 2)
        # what the decode cache really allocates for a context of T tokens
        model = AAHModule(gpt=gpt).model
        model.set_windows(KV_TABLE)
        cache, _ = gen.prefill(model, [list(range(1, 49))], max_new_tokens=16)
        assert cache.nbytes == kv.window * 64
    assert kv_group_windows(KV_TABLE, 2).tolist() == [[8, 64], [64, 4]]
    # an attention sink of 4: each windowed head keeps 4 positions more (at most the 64 of the context):
    # 8+12+64+20 + 64+8+8+8 = 192 positions -> 192 B
    gpt = GPTConfig(n_layer=2, n_head=4, n_embd=32, seq_len=64)
    kv = model_card.kv_saving(torch.tensor(KV_TABLE), gpt, sink=4)
    assert (kv.window, kv.full) == (192, 512)
    model = AAHModule(gpt=gpt, aah={"sink": 4}).model
    model.set_windows(KV_TABLE)
    cache, _ = gen.prefill(model, [list(range(1, 49))], max_new_tokens=16)
    assert cache.nbytes == kv.window * 64


def test_the_card_states_acr_and_kv_saving_of_a_gqa_export(exported):
    module = llama_module(dict(GQA, n_kv_head=2), seed=3, table=torch.tensor([*KV_TABLE, [64, 64, 2, 2]]))
    folder = exported(module, name="card")
    card = open(os.path.join(folder, "README.md")).read()
    # ACR: (4+8+64+16 + 64+4+4+4 + 64+64+2+2) / (12 x 64) = 300 / 768
    assert "T = 64): **0.391**" in card
    # KV: group windows [8, 64], [64, 4], [64, 2] -> 206 positions x head size 8 x 2 x 4 B / 64 = 206 B; full 3 x 2 x
    # 8 x 2 x 4 = 384 B; 206 / 384 = 0.536 kept, 46.4 % saved
    line = next(x for x in card.splitlines() if x.startswith("- KV cache per token"))
    assert "2 key/value heads for 4 query heads" in line and "float32" in line
    assert "**206 B** with the windows against **384 B** for full attention: **0.536** of it kept" in line
    assert "a saving of **46.4 %**" in line
    assert "2 key/value heads (grouped-query attention)" in card and "SwiGLU MLP of width 48" in card
    assert "untied output layer" in card and "llama3 scaling x4" in card


def test_an_imported_qwen3_with_a_padded_vocabulary_exports_with_transformers_logits(tmp_path):
    """Qwen3 (q/k norm, head size 16 at width 32) with 80 embedding rows for a tokenizer of 64 ids: ``aah import``
    keeps the rows, ``aah export`` ships the tokenizer as it is, and transformers' logits of the export are those of
    the original model."""
    theirs = save_tiny("qwen3", tmp_path / "hf", vocab_size=80)
    save_tokenizer(tmp_path / "hf")
    assert exit_code(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "q.ckpt")]) == 0
    assert exit_code(["export", "--ckpt_path", str(tmp_path / "q.ckpt"), "--out", str(tmp_path / "export")]) == 0
    hf = load(str(tmp_path / "export"))
    tok = AutoTokenizer.from_pretrained(tmp_path / "export", trust_remote_code=True)
    assert hf.config.vocab_size == 80 and len(tok) == 64 and hf.config.qk_norm and hf.config.head_dim == 16
    tokens = torch.randint(64, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, theirs(tokens).logits, rtol=1e-4, atol=1e-4)


# -- the whole way: Hugging Face folder -> aah import -> retrofit -> aah export -> lm-eval ----------------------------
T = 256


@pytest.fixture(scope="module")
def retrofitted(tmp_path_factory):
    """A tiny Llama 3 folder of transformers' own classes (GQA, llama3 scaling, untied; byte-level tokenizer.json),
    imported with ``aah import``, retrofitted with configs/retrofit/hf_import.yaml (the gain signal decides at step 0
    under ACR 0.25; two fine-tuning steps on Python source) and exported with ``aah export``."""
    root = tmp_path_factory.mktemp("llama_way")
    hf_folder = root / "hf"
    save_tiny("llama3", hf_folder, seed=4, vocab_size=257, max_position_embeddings=T)
    byte_level_tokenizer().save(str(hf_folder / "tokenizer.json"))
    imported = root / "imported.ckpt"
    assert exit_code(["import", str(hf_folder), "--out", str(imported)]) == 0

    overlay = root / "source.yaml"
    from aah_lightning import retrofit

    overlay.write_text(yaml.safe_dump(retrofit.overlay(imported)))
    stdlib = sysconfig.get_paths()["stdlib"]
    corpus = root / "python.txt"  # some standard library sources, as text
    corpus.write_text("".join(open(os.path.join(stdlib, n)).read() for n in ("json/decoder.py", "textwrap.py")))
    recipe = os.path.join(REPO, "configs", "retrofit", "hf_import.yaml")
    main(
        [
            "fit",
            "--config",
            recipe,
            "--config",
            str(overlay),
            "--trainer.accelerator=cpu",
            "--trainer.precision=32-true",
            "--trainer.max_steps=2",
            "--trainer.val_check_interval=2",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
            "--trainer.logger=false",
            f"--checkpoint.dirpath={root}/ckpt",
            "--data.source=files",
            f"--data.files.paths=[{corpus}]",
            f"--data.seq_len={T}",
            "--data.batch_size=2",
            "--data.global_batch_size=null",
            "--model.aah.candidates=null",  # T/8 .. T
            "--model.gpt.activation_checkpointing=false",
            "--model.aah.controller.need.probe_sequences=2",
            "--model.optim.lr=1e-3",
            "--model.optim.warmup_steps=1",
        ]
    )
    last = root / "ckpt" / "last.ckpt"
    out = root / "export"
    assert exit_code(["export", "--ckpt_path", str(last), "--out", str(out)]) == 0
    return {"imported": imported, "ckpt": last, "export": str(out), "root": root}


@pytest.mark.heavy  # its fixture runs aah import, an aah fit of two steps and aah export (a few seconds)
def test_the_retrofitted_import_exports_with_its_windows_logits_and_text(retrofitted):
    model, _ = ck.load_model(retrofitted["ckpt"])
    source, _ = ck.load_model(retrofitted["imported"])
    table = model.windows
    acr = float((table.clamp(max=T).double() / T).mean())
    assert acr <= 0.25 + 1e-9 and int(table.min()) < T  # decided at step 0 under the recipe's budget
    assert not torch.equal(model.wte.weight, source.wte.weight)  # fine-tuned from the import
    assert model.cfg.kv_heads == 2 and not model.cfg.tie_embeddings and model.cfg.rope_scaling == "llama3"

    folder = retrofitted["export"]
    hf, tok = load(folder), AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    assert hf.config.windows == table.tolist()
    ids = torch.randint(0, 257, (2, T), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert (hf(ids).logits - model(ids, backend="sdpa")).abs().max().item() <= 1e-4
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    assert all(p[0] == 256 for p in prompts)
    want = gen.generate(model, prompts, gen.GenerationConfig(max_new_tokens=30, temperature=0.0), eod_id=256)
    for prompt, w in zip(prompts, want):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt) :].tolist()
        assert out[: len(w.tokens)] == w.tokens
    card = open(os.path.join(folder, "README.md")).read()
    kv = model_card.kv_saving(table, model.cfg)
    assert f"**{acr:.3f}**" in card and f"**{kv.window:,.0f} B** with the windows" in card


def own_loglikelihood(model, head: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([head + continuation])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids, backend="sdpa")[0, :-1].double(), -1)
    return float(logp[torch.arange(len(head) - 1, ids.shape[1] - 1), ids[0, len(head) :]].sum())


@pytest.mark.heavy  # an lm-eval subprocess: ~20 s on an idle 2-core machine
def test_lm_eval_runs_the_retrofitted_export_with_aahs_own_scores(retrofitted, tmp_path):
    out = tmp_path / "results"
    run_lm_eval(retrofitted["export"], out, tmp_path, limit=8)
    results = json.load(open(glob.glob(str(out / "*" / "results_*.json"))[0]))
    assert results["max_length"] == T
    samples = [json.loads(x) for x in open(glob.glob(str(out / "*" / "samples_aah_python_next_line_*.jsonl"))[0])]
    assert len(samples) == 8

    model, _ = ck.load_model(retrofitted["ckpt"])  # aah's own model, not the export

    def score(context: str, continuation: str) -> float:
        head = [256] + (list(context.rstrip().encode()) if context else [])
        return own_loglikelihood(model, head, list(continuation.encode()))

    examples = [json.loads(x) for x in open(os.path.join(task.TASK_DIR, "data.jsonl"))][:8]
    for sample in samples:
        ex = examples[sample["doc_id"]]
        theirs = [float(r[0]) for r in sample["filtered_resps"]]
        mine = [score(ex["context"], task._continuation(ex["context"], c)) for c in ex["choices"]]
        mine += [score("", c) for c in ex["choices"]]
        assert np.allclose(theirs, mine, atol=1e-3), (theirs, mine)
    scores = results["results"]["aah_python_next_line"]
    assert {k: scores[f"{k},none"] for k in ("acc", "acc_norm", "acc_mutual_info")} == task.accuracy(examples, score)
