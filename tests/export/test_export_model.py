"""The exported model computes what aah's model computes: logits, incremental decoding, greedy generation, and a
window table that survives save_pretrained / from_pretrained."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from aah_lightning.model import generate as gen
from helpers.cli import run_tool

PROMPTS = [
    "def fib(n):\n    ",
    "import os\nimport sys\n\n\nclass Reader:\n    def __init__(self, path):\n        self.p",
]


def load(folder: str):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()


@pytest.mark.parametrize("sink", [0, 3])
def test_logits_equal_aah_with_random_windows_shorter_than_the_prompt(exported, make_module, sink):
    module = make_module(seed=0, seq_len=64, sink=sink)
    windows = module.model.windows
    assert int(windows.min()) == 1 and (windows < 40).sum() >= 3 and (windows >= 64).any()  # short and full heads
    folder = exported(module)
    hf = load(folder)
    assert type(hf).__name__ == "AAHForCausalLM" and hf.dtype == torch.float32
    assert hf.config.windows == windows.tolist() and hf.config.sink == sink
    ids = torch.randint(0, 257, (3, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = hf(ids).logits
        for backend in ("sdpa", "auto"):
            want = module.model(ids, backend=backend)
            assert (got - want).abs().max().item() <= 1e-5, backend
        # A head's window matters: the same weights with every window full give other logits.
        full = make_module(seed=0, seq_len=64, table=torch.full((3, 4), 64)).model(ids)
        assert (full - got).abs().max().item() > 1e-2
        # ... and so does the sink: the same model with another one gives other logits
        other = make_module(seed=0, seq_len=64, sink=3 - sink, table=windows).model(ids)
        assert (other - got).abs().max().item() > 1e-3
    if not sink:  # an export written before the config had a sink loads as one without
        with open(os.path.join(folder, "config.json")) as f:
            config = json.load(f)
        del config["sink"]
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
        old = load(folder)
        assert old.config.sink == 0
        with torch.no_grad():
            assert torch.equal(old(ids).logits, got)


@pytest.mark.parametrize("sink", [0, 4])
def test_incremental_decoding_with_a_cache_equals_one_forward(exported, make_module, sink):
    hf = load(exported(make_module(seed=1, sink=sink)))
    ids = torch.randint(0, 257, (2, 90), generator=torch.Generator().manual_seed(1))  # past the trained T = 64
    with torch.no_grad():
        whole = hf(ids, use_cache=False).logits
        cache = DynamicCache()
        parts = [hf(ids[:, a:b], past_key_values=cache).logits for a, b in ((0, 37), (37, 38), (38, 90))]
    assert (torch.cat(parts, 1) - whole).abs().max().item() <= 1e-5
    with torch.no_grad():
        loss = hf(ids, labels=ids).loss
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(whole[:, :-1].flatten(0, 1), ids[:, 1:].flatten()))


def test_greedy_generate_equals_aah_generation(exported, make_module):
    module = make_module(seed=2)
    folder = exported(module)
    hf = load(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    assert all(p[0] == 256 for p in prompts)  # the end-of-document token first, as aah's prompts start
    cfg = gen.GenerationConfig(max_new_tokens=60, temperature=0.0)
    want = gen.generate(module.model, prompts, cfg, eod_id=256)
    for prompt, w in zip(prompts, want):
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False)[0, len(prompt) :].tolist()
        assert len(set(out)) > 5  # varied text: the comparison is not between two runs of one repeated token
        assert out[: len(w.tokens)] == w.tokens
        assert (w.stop, out[len(w.tokens) :]) in (("length", []), ("eod", [256]))
        assert len(prompt) + len(out) > 64  # generation ran past the trained length

    # A batch with left padding (the tokenizer's own side, as transformers wants for decoders) generates the same
    # continuations.
    assert tok.padding_side == "left"
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    out = hf.generate(**batch, max_new_tokens=60, do_sample=False)[:, batch.input_ids.shape[1] :]
    for row, w in zip(out.tolist(), want):
        assert row[: len(w.tokens)] == w.tokens


def test_greedy_generate_equals_tools_generate(exported, make_module, write_checkpoint, tmp_path, capsys):
    module = make_module(seed=3)
    ckpt = write_checkpoint(module, tmp_path / "m.ckpt")
    folder = exported(module, name="tool")
    prompt = "def fib(n):\n    "
    assert run_tool("generate", ckpt, "--prompt", prompt, "--max-new-tokens", "50", "--temperature", "0") == 0
    printed = capsys.readouterr().out
    hf, tok = load(folder), AutoTokenizer.from_pretrained(folder)
    ids = tok(prompt, return_tensors="pt").input_ids
    out = hf.generate(ids, max_new_tokens=50, do_sample=False)
    text = tok.decode(out[0], skip_special_tokens=True)
    assert len(text) > len(prompt) + 5
    assert printed == text + "\n"


def test_window_table_survives_save_pretrained_and_from_pretrained(exported, make_module, tmp_path):
    hf = load(exported(make_module(seed=4)))
    table = [[5, 1, 64, 9], [2, 33, 17, 64], [64, 3, 3, 12]]
    hf.set_windows(table)
    hf.save_pretrained(tmp_path / "again")
    with open(tmp_path / "again" / "config.json") as f:
        assert json.load(f)["windows"] == table
    assert not any(name.endswith((".bin", ".pt", ".pth", ".pkl")) for name in os.listdir(tmp_path / "again"))
    again = load(str(tmp_path / "again"))
    assert again.windows.tolist() == table and again.windows.dtype == torch.int32
    ids = torch.randint(0, 257, (1, 40))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, hf(ids).logits)
    with pytest.raises(ValueError, match="shape"):
        hf.set_windows([[1, 2], [3, 4]])
    assert hf.windows.tolist() == table  # a refused table leaves the old one


def test_both_attention_implementations_compute_the_same_logits(exported, make_module):
    module = make_module(seed=5)
    folder = exported(module)
    ids = torch.randint(0, 257, (2, 64), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = module.model(ids)
        for impl in ("sdpa", "eager"):
            hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, attn_implementation=impl).eval()
            assert hf.config._attn_implementation == impl
            assert (hf(ids).logits - want).abs().max().item() <= 1e-5, impl


def test_hidden_states_and_attentions_are_what_transformers_documents(exported, make_module):
    module = make_module(seed=6)
    hf = load(exported(module))
    ids = torch.randint(0, 257, (2, 50), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True, output_attentions=True)
        plain = hf(ids)
    assert plain.hidden_states is None and plain.attentions is None  # only when asked
    assert (out.logits - plain.logits).abs().max().item() <= 1e-5  # the eager weights give the same output
    n_layer, n_head = module.model.windows.shape
    # The embeddings, each block's input, and the final (normalised) output the logits are computed from.
    assert len(out.hidden_states) == n_layer + 1
    assert torch.equal(out.hidden_states[0], hf.model.wte(ids))
    last = out.hidden_states[-1] @ hf.model.wte.weight.T
    assert (last - out.logits).abs().max().item() <= 1e-4
    assert len(out.attentions) == n_layer and out.attentions[0].shape == (2, n_head, 50, 50)
    for layer, weights in enumerate(out.attentions):
        assert torch.allclose(weights.sum(-1), torch.ones(2, n_head, 50), atol=1e-5)  # rows are distributions
        distance = torch.arange(50).view(-1, 1) - torch.arange(50).view(1, -1)
        for head, w in enumerate(module.model.windows[layer].tolist()):
            outside = (distance < 0) | (distance >= w)
            assert weights[:, head][:, outside].abs().max().item() == 0.0  # nothing outside the head's window
        assert weights.amax().item() > 0.1


@pytest.mark.parametrize("cache", ["static", "sliding_window"])
def test_a_fixed_size_cache_is_refused_in_one_line(exported, make_module, cache):
    hf = load(exported(make_module(seed=7)))
    ids = torch.tensor([[256, 100, 101]])
    with pytest.raises(ValueError) as raised:
        hf.generate(ids, max_new_tokens=3, do_sample=False, cache_implementation=cache)
    assert str(raised.value) == (
        "aah models keep their keys and values in their window cache (the default) or a DynamicCache "
        f'(cache_implementation="dynamic"): cache_implementation={cache!r} is not supported; leave '
        "cache_implementation unset"
    )
    from transformers import GenerationConfig

    with pytest.raises(ValueError, match="is not supported; leave cache_implementation unset"):  # in a config too
        hf.generate(ids, generation_config=GenerationConfig(max_new_tokens=3, cache_implementation=cache))
    assert hf.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, 6)  # the default still generates


def test_a_fixed_size_cache_object_is_refused_in_one_line(exported, make_module):
    from transformers import StaticCache

    hf = load(exported(make_module(seed=7)))
    try:
        cache = StaticCache(config=hf.config, max_cache_len=16)
    except TypeError:  # transformers 4.5x: batch size and device too
        cache = StaticCache(config=hf.config, max_batch_size=1, max_cache_len=16)
    with pytest.raises(ValueError) as raised:
        hf(torch.tensor([[256, 100, 101]]), past_key_values=cache)
    assert str(raised.value).startswith(
        "aah models keep their keys and values in their window cache (AAHWindowCache, the default) or a DynamicCache, "
        "not a StaticCache"
    )
    assert "\n" not in str(raised.value)


def test_config_json_carries_the_dtype_and_leaves_the_attention_choice_to_transformers(exported, make_module):
    folder = exported(make_module(seed=8))
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    assert not [key for key in config if key.startswith("_attn_implementation")]
    assert load(folder).config._attn_implementation == "sdpa"  # the default (transformers 4.50 chose eager)
