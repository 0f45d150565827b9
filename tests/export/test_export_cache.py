"""The exported model's own cache (``AAHWindowCache``, what ``generate`` uses by default): it keeps per key/value head
the sink positions and a ring of the widest window, and computes what aah's model computes: logits and greedy tokens
over generations far past every window, sampling and beam search, left-padded batches with a sink, chunked forward
passes; it allocates the bytes the model card states; a ``DynamicCache`` passed in still gives the same tokens."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from aah_lightning.export import model_card
from aah_lightning.lit.module import AAHModule
from aah_lightning.model import generate as gen
from aah_lightning.model.config import GPTConfig

# generate's name for a cache passed in (transformers 5 renamed ``past_key_values`` to ``cache``)
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
T = 64
# Windows far below the texts of the tests (prompts of 70 tokens, 100 more generated): every ring wraps around many
# times, sinks of 4 stay. Under 2 key/value heads for 4 query heads, the query heads of one key/value head differ.
TABLE = [[1, 5, 12, T], [7, 7, 3, 20], [T, 2, 9, 30]]


def module(n_kv_head: int | None = None, sink: int = 4, table=TABLE, seed: int = 0) -> AAHModule:
    """A tiny byte-vocabulary model (Llama-like under ``n_kv_head``) with weights pushed away from their
    initialisation, so that greedy text is varied."""
    torch.manual_seed(seed)
    llama = dict(n_kv_head=n_kv_head, mlp="swiglu", norm="rmsnorm") if n_kv_head else {}
    gpt = GPTConfig(n_layer=3, n_head=4, n_embd=32, seq_len=T, vocab_size=257, **llama)
    m = AAHModule(gpt=gpt, aah={"sink": sink})
    m.model.set_windows(table)
    with torch.no_grad():
        for p in m.model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return m.eval()


def load(folder: str):
    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()


def returned_cache(out):
    return out.get("cache", out.get("past_key_values"))  # transformers 5 renamed the field


def prompt(n: int, seed: int = 0) -> list[int]:
    return [256, *torch.randint(0, 256, (n - 1,), generator=torch.Generator().manual_seed(seed)).tolist()]


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), 256)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :], mask[row, width - len(p) :] = torch.tensor(p), 1
    return ids, mask


@pytest.mark.parametrize("n_kv_head,sink", [(None, 4), (2, 4), (2, 0)])
def test_logits_and_greedy_tokens_equal_aahs_far_past_every_window(exported, n_kv_head, sink):
    m = module(n_kv_head, sink)
    hf = load(exported(m))
    ids = torch.tensor([prompt(70)])  # longer than the widest window
    out = hf.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=100, do_sample=False, eos_token_id=None,
        return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    cache = returned_cache(out)
    assert type(cache).__name__ == "AAHWindowCache" and cache.get_seq_length() == 169
    tokens = out.sequences[0, 70:].tolist()
    assert len(set(tokens)) > 10  # varied text: no run of one repeated token

    # aah's own decoding, fed the same tokens, gives the same logits at every step
    window_cache, logits = gen.prefill(m.model, ids.tolist(), 100)
    for step, theirs in enumerate(out.logits):
        assert (theirs - logits).abs().max().item() <= 1e-4, step
        assert int(logits.argmax(-1)) == tokens[step]
        if step < 99:
            logits = gen.decode_step(m.model, window_cache, torch.tensor([tokens[step]]))
    # ... and the same greedy text as aah's generation
    want = gen.generate(m.model, ids.tolist(), gen.GenerationConfig(max_new_tokens=100, temperature=0.0))[0]
    assert tokens[: len(want.tokens)] == want.tokens
    # the cache holds what aah's cache holds for the same text, not every position
    assert cache.nbytes == window_cache.nbytes
    full = gen.full_cache_bytes(3, m.gpt_config.kv_heads, 169, m.gpt_config.head_dim)
    assert cache.nbytes < full / 2


def test_the_cache_allocates_the_bytes_the_model_card_states(exported):
    m = module(n_kv_head=2, sink=4)
    folder = exported(m)
    hf = load(folder)
    # generate sizes its cache for the longest text it can reach: here the trained T, the card's context
    prompts = [prompt(20, seed=1), prompt(9, seed=2)]
    ids, mask = left_padded(prompts)
    out = hf.generate(
        ids, attention_mask=mask, max_new_tokens=T - ids.shape[1] + 1, do_sample=False, return_dict_in_generate=True
    )
    kv = model_card.kv_saving(m.model.windows, m.gpt_config, torch.float32, sink=4)
    # group windows [5, T], [7, 20], [T, 30] + 4 sink slots each where they fit: 9 + 64 + 11 + 24 + 64 + 34 = 206
    # positions x head size 8 x keys and values x 4 bytes / T = 206 B per token of context
    assert kv.window == 206
    assert returned_cache(out).nbytes == kv.window * T * len(prompts)
    card = open(os.path.join(folder, "README.md")).read()
    assert f"**{kv.window:,.0f} B** with the windows" in card


def test_a_dynamic_cache_passed_in_is_still_accepted_and_gives_the_same_tokens(exported):
    hf = load(exported(module(n_kv_head=2)))
    ids = torch.tensor([prompt(70, seed=3)])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=60, do_sample=False, return_dict_in_generate=True)
    default = hf.generate(ids, **kw)
    for dynamic in ({CACHE: DynamicCache()}, {"cache_implementation": "dynamic"}):
        out = hf.generate(ids, **dynamic, **kw)
        cache = returned_cache(out)
        assert type(cache) is DynamicCache and cache.get_seq_length() == 129  # every position kept
        assert torch.equal(out.sequences, default.sequences)
    assert torch.equal(hf.generate(ids, **dict(kw, use_cache=False)).sequences, default.sequences)


def test_left_padded_batches_keep_each_rows_own_sink(exported):
    """Each row's sink is the first tokens of its own text, after its padding (before, the padding columns were)."""
    m = module(sink=4)
    hf = load(exported(m))
    prompts = [prompt(3, seed=4), prompt(40, seed=5), prompt(17, seed=6)]
    want = gen.generate(m.model, prompts, gen.GenerationConfig(max_new_tokens=80, temperature=0.0, stop_at_eod=False))
    ids, mask = left_padded(prompts)
    for cache in ({}, {CACHE: DynamicCache()}):
        rows = hf.generate(ids, attention_mask=mask, max_new_tokens=80, do_sample=False, eos_token_id=None, **cache)
        for row, w in zip(rows[:, ids.shape[1] :].tolist(), want):
            assert row == w.tokens


@pytest.mark.parametrize(
    "settings",
    [dict(do_sample=True, top_k=20), dict(num_beams=3), dict(do_sample=True, num_return_sequences=2)],
    ids=["sampling", "beam_search", "two_samples_each"],
)
def test_sampling_and_beam_search_through_the_window_cache_equal_the_full_cache(exported, settings):
    hf = load(exported(module(n_kv_head=2, seed=1)))
    ids, mask = left_padded([prompt(70, seed=7), prompt(45, seed=8)])

    def run(**cache):
        torch.manual_seed(0)
        out = hf.generate(
            ids, attention_mask=mask, max_new_tokens=60, return_dict_in_generate=True, **cache, **settings
        )
        return out.sequences, type(returned_cache(out)).__name__

    ours, name = run()
    assert name == "AAHWindowCache"
    assert torch.equal(ours, run(**{CACHE: DynamicCache()})[0])
    assert torch.equal(ours, run(use_cache=False)[0])


def test_chunks_through_the_window_cache_equal_one_forward(exported):
    """Chunks of any length, over a cache that grows as it goes or is sized in advance: a chunk after the rings
    wrapped (its own queries need keys the ring would overwrite), one token at a time, a long one; the weights of
    ``output_attentions`` are those of the whole forward."""
    m = module(n_kv_head=2)
    hf = load(exported(m))
    cache_class = sys.modules[type(hf).__module__].AAHWindowCache
    ids = torch.randint(0, 257, (2, 160), generator=torch.Generator().manual_seed(9))
    chunks = ((0, 37), (37, 38), (38, 90), (90, 91), (91, 92), (92, 160))
    with torch.no_grad():
        whole = hf(ids, use_cache=False, output_attentions=True)
        assert (whole.logits - m.model(ids, backend="sdpa")).abs().max().item() <= 1e-4
        for max_len in (None, 160, 300):
            cache = cache_class(hf.config, max_len)
            outs = [hf(ids[:, a:b], past_key_values=cache, output_attentions=True) for a, b in chunks]
            assert (torch.cat([o.logits for o in outs], 1) - whole.logits).abs().max().item() <= 1e-4, max_len
            for layer, weights in enumerate(outs[-1].attentions):  # [B, H, 68 queries, 160 keys]
                assert (weights - whole.attentions[layer][:, :, 92:]).abs().max().item() <= 1e-5
            # what a text of 160 tokens needs, or the length it was sized for
            held = max(160, max_len or 0)
            assert cache.nbytes == gen.cache_bytes(m.model.windows.tolist(), held, 8, 2, n_kv_head=2, sink=4)
        # the forward without a cache passed in returns one, which goes on
        first = hf(ids[:, :100], use_cache=True)
        cache = returned_cache(first)
        assert type(cache).__name__ == "AAHWindowCache"
        assert (hf(ids[:, 100:], past_key_values=cache).logits - whole.logits[:, 100:]).abs().max().item() <= 1e-4


def test_the_window_cache_refuses_what_it_cannot_do_in_one_line(exported):
    hf = load(exported(module()))
    ids = torch.tensor([prompt(30)])
    cache = returned_cache(hf.generate(ids, max_new_tokens=5, do_sample=False, return_dict_in_generate=True))
    cache.crop(cache.get_seq_length())  # nothing to take back: fine
    with pytest.raises(ValueError, match="cannot be cropped") as raised:
        cache.crop(-1)
    assert "\n" not in str(raised.value)
    with pytest.raises(NotImplementedError, match="read by the aah model's attention"):
        cache.update(torch.zeros(1, 4, 1, 8), torch.zeros(1, 4, 1, 8), 0)
    # a cache of another model
    config = copy.deepcopy(hf.config)
    config.num_hidden_layers, config.windows = 2, config.windows[:2]
    other = sys.modules[type(hf).__module__].AAHWindowCache(config)
    with pytest.raises(ValueError, match="this AAHWindowCache has 2 layers, the model 3"):
        hf(ids, past_key_values=other)
