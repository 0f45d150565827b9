"""The per-head window KV cache: incremental decoding against one full forward (with and without an attention sink),
ring buffers, sampling."""

from __future__ import annotations

import pytest
import torch

from aah_lightning.errors import ConfigError
from aah_lightning.model import generate as gen
from aah_lightning.model.attention import Recording
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT
from aah_lightning.model.window_math import kv_group_windows


def tiny_model(seq_len=24, n_layer=2, n_head=4, windows=None, dtype=torch.float64, backend="sdpa", sink=0) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=40, seq_len=seq_len, n_layer=n_layer, n_head=n_head, n_embd=32, backend=backend)
    model = GPT(cfg, sink=sink)
    if windows is not None:
        model.set_windows(windows)
    return model.to(dtype).eval()


def decode_matches_forward(model: GPT, prompts: list[list[int]], steps: int, seed: int = 0) -> float:
    """Largest |decode logits - full forward logits| over every step of every row, feeding random tokens."""
    g = torch.Generator().manual_seed(seed)
    cache, logits = gen.prefill(model, prompts, steps)
    rows = [list(p) for p in prompts]
    worst = 0.0
    for step in range(steps + 1):
        for b, row in enumerate(rows):
            with torch.no_grad():
                full = model(torch.tensor([row]))[0, -1]
            worst = max(worst, (logits[b] - full).abs().max().item())
        if step == steps:
            break
        nxt = torch.randint(model.cfg.vocab_size, (len(rows),), generator=g)
        for row, t in zip(rows, nxt.tolist()):
            row.append(t)
        logits = gen.decode_step(model, cache, nxt)
    return worst


def random_prompts(lengths, vocab=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize(
    "windows",
    [
        [[1, 3, 24, 5], [2, 24, 7, 1]],  # W = 1, windows shorter and longer than the prompts, full heads
        [[24, 24, 24, 24], [24, 24, 24, 24]],  # every head full: slides at seq_len past it
        [[4, 4, 4, 4], [9, 9, 2, 2]],  # one group per layer / two groups
    ],
)
@pytest.mark.parametrize("sink", [0, 3])
def test_decode_equals_full_forward_float64(windows, sink):
    model = tiny_model(windows=windows, sink=sink)
    # Unequal prompts (1 to 17 tokens), decoded past the trained seq_len (24): the rings wrap several times; with a
    # sink the first positions stay (the 1-token prompt decodes into them), full heads get one past seq_len.
    worst = decode_matches_forward(model, random_prompts([5, 17, 1, 11]), steps=10)
    assert worst < 1e-9


@pytest.mark.parametrize("sink", [0, 4])
def test_decode_exact_with_banded_prefill(sink):
    """A prefill long enough for the banded backend (T >= 256 on CPU) fills the same cache."""
    windows = [[1, 16, 100, 300], [300, 37, 300, 5]]
    model = tiny_model(seq_len=300, windows=windows, backend="auto", sink=sink)
    assert {p.kind for p in model.attention_plans(320)} == {"banded"}
    assert decode_matches_forward(model, random_prompts([260, 120, 300]), steps=6) < 1e-9


def test_ring_buffer_wraps_and_holds_the_newest_positions():
    model = tiny_model(windows=[[3, 5, 8, 24], [3, 5, 8, 24]])
    prompts = random_prompts([7, 2])
    cache, _ = gen.prefill(model, prompts, max_new_tokens=30)
    assert cache.slots[0] == [3, 5, 8, 24]  # min(W, longest prompt + max_new_tokens = 37)
    # Reference: the keys after RoPE of one full forward, captured from the model itself.
    row = prompts[0] + list(range(10))
    captured = [Recording(plan) for plan in model.attention_plans(len(row))]
    with torch.no_grad():
        model(torch.tensor([row]), plans=captured)
    keys = captured[0].records[0][1][0]  # [H, T, D]
    for t in row[len(prompts[0]) :]:
        gen.decode_step(model, cache, torch.tensor([t, t]))
    last = len(row) - 1  # position 16: the 3-slot ring has wrapped five times
    for group in cache.layers[0]:
        heads = range(4) if group.heads is None else group.heads.tolist()
        for i, h in enumerate(heads):
            for s in range(group.slots):
                p = last - (last - s) % group.slots
                if p < 0:  # not reached yet (the 24-slot ring holds positions 0..16)
                    continue
                torch.testing.assert_close(group.k[0, i, s], keys[h, p], rtol=0, atol=1e-12)


def test_cache_bytes_follow_the_windows():
    windows = [[2, 8, 64, 64], [64, 64, 4, 16]]
    model = tiny_model(seq_len=64, windows=windows)
    cache, _ = gen.prefill(model, random_prompts([50, 30]), max_new_tokens=14)  # max_len = 64
    d = model.cfg.head_dim
    expected = sum(min(w, 64) for row in windows for w in row) * d * 2 * 8 * 2  # float64, batch 2
    assert cache.nbytes == expected == gen.cache_bytes(windows, 64, d, batch=2, dtype=torch.float64)
    full = gen.full_cache_bytes(2, 4, 64, d, batch=2, dtype=torch.float64)
    assert cache.nbytes / full == pytest.approx(sum(min(w, 64) for r in windows for w in r) / (8 * 64), abs=0)
    # an attention sink of 4: each head keeps 4 + W positions (at most the 64 it can ever see)
    model.sink = 4
    cache, _ = gen.prefill(model, random_prompts([50, 30]), max_new_tokens=14)
    expected = sum(min(4 + w, 64) for row in windows for w in row) * d * 2 * 8 * 2
    assert cache.nbytes == expected == gen.cache_bytes(windows, 64, d, batch=2, dtype=torch.float64, sink=4)
    assert gen.slot_counts(windows, 64, sink=4) == [[6, 12, 64, 64], [64, 64, 8, 20]]


@pytest.mark.parametrize("sink", [0, 2])
def test_greedy_is_the_argmax_of_the_full_forward(sink):
    model = tiny_model(windows=[[3, 24, 5, 7], [24, 2, 24, 9]], sink=sink)
    prompts = random_prompts([6, 3])
    out = gen.generate(model, prompts, gen.GenerationConfig(max_new_tokens=8, temperature=0, stop_at_eod=False))
    for p, c in zip(prompts, out):
        row = list(p)
        for t in c.tokens:
            with torch.no_grad():
                assert t == model(torch.tensor([row]))[0, -1].argmax().item()
            row.append(t)
        assert c.stop == "length" and len(c.tokens) == 8


def test_stop_at_end_of_document():
    model = tiny_model(windows=[[3, 24, 5, 7], [24, 2, 24, 9]], dtype=torch.float32)
    prompts = random_prompts([6, 3])
    cfg = gen.GenerationConfig(max_new_tokens=12, temperature=1.0, seed=3, stop_at_eod=False)
    tokens = [c.tokens for c in gen.generate(model, prompts, cfg)]
    # Declare a token the second row draws mid-way the end-of-document token: that row stops right before it, and
    # (same seed, per-prompt generators) draws the same tokens up to there.
    cut = next(i for i, t in enumerate(tokens[1]) if i > 0 and t not in tokens[1][:i])
    eod = tokens[1][cut]
    stopped = gen.generate(model, prompts, gen.GenerationConfig(**{**cfg.__dict__, "stop_at_eod": True}), eod_id=eod)
    assert stopped[1].tokens == tokens[1][:cut] and stopped[1].stop == "eod"
    first = tokens[0]
    assert stopped[0].tokens == (first[: first.index(eod)] if eod in first else first)
    assert stopped[0].stop == ("eod" if eod in first else "length")


def test_sampling_is_seeded_per_prompt():
    model = tiny_model(windows=[[3, 24, 5, 7], [24, 2, 24, 9]], dtype=torch.float32)
    prompts = random_prompts([6, 3, 9])
    cfg = gen.GenerationConfig(max_new_tokens=12, temperature=1.0, top_k=10, top_p=0.9, seed=7, stop_at_eod=False)
    a = [c.tokens for c in gen.generate(model, prompts, cfg)]
    b = [c.tokens for c in gen.generate(model, prompts, cfg)]
    assert a == b
    # Prompt 2 alone, with its index, draws the same tokens as inside the batch.
    alone = gen.generate(model, prompts[2:], cfg, indices=[2])
    assert alone[0].tokens == a[2]
    other = gen.generate(model, prompts, gen.GenerationConfig(**{**cfg.__dict__, "seed": 8}))
    assert [c.tokens for c in other] != a


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])

    def draws(cfg):
        return {gen.sample(logits, cfg, [gen.row_generator(cfg.seed, i, "cpu")]).item() for i in range(300)}

    assert draws(gen.GenerationConfig(temperature=1.0, top_k=2)) == {0, 1}
    probs = torch.softmax(logits[0], -1)  # 0.64, 0.24, 0.09, ...: 0.64 + 0.24 reaches 0.85
    assert probs[:2].sum() > 0.85 > probs[0]
    assert draws(gen.GenerationConfig(temperature=1.0, top_p=0.85)) == {0, 1}
    assert draws(gen.GenerationConfig(temperature=1.0, top_p=0.5)) == {0}
    assert draws(gen.GenerationConfig(temperature=1.0)) == {0, 1, 2, 3, 4}


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("max_new_tokens", 0, "generate.max_new_tokens=0"),
        ("temperature", -0.1, "generate.temperature=-0.1"),
        ("top_k", -1, "generate.top_k=-1"),
        ("top_p", 0.0, "generate.top_p=0.0"),
        ("top_p", 1.5, "generate.top_p=1.5"),
    ],
)
def test_bad_settings(field, value, words):
    with pytest.raises(ConfigError, match=words.replace(".", r"\.")):
        gen.GenerationConfig(**{field: value}).validate()


@pytest.mark.heavy  # an end-to-end tool run in a subprocess
def test_decode_benchmark_runs_on_tiny_shapes():
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    args = ["--contexts", "64", "--batch", "2", "--repeats", "1", "--prefill-repeats", "1", "--threads", "1"]
    out = subprocess.run(
        [sys.executable, str(repo / "tools" / "bench_decode.py"), *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=repo,
    ).stdout
    assert "| 64 | full |" in out and "| 64 | AAH |" in out
    assert "AAH cache / full cache == sum min(W, T) / (H T) exactly, T=64 | 0.2969 vs 0.2969 | met" in out


# -- grouped-query attention -------------------------------------------------------------------------------------------
def gqa_model(n_kv_head, windows, seq_len=24, n_head=4, sink=0) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=40, seq_len=seq_len, n_layer=2, n_head=n_head, n_kv_head=n_kv_head, n_embd=32)
    model = GPT(cfg, sink=sink)
    model.set_windows(windows)
    return model.double().eval()


def test_kv_group_windows_keep_the_widest_window_of_each_group():
    table = [[1, 3, 24, 5], [2, 2, 7, 9]]
    assert kv_group_windows(table, 2).tolist() == [[3, 24], [2, 9]]
    assert kv_group_windows(table, 1).tolist() == [[24], [9]]
    assert kv_group_windows(table, 4).tolist() == table
    with pytest.raises(ValueError, match="n_kv_head=3 does not divide the table's 4 heads"):
        kv_group_windows(table, 3)


@pytest.mark.parametrize("n_kv_head", [1, 2])
@pytest.mark.parametrize(
    "windows",
    [
        [[1, 3, 24, 5], [2, 24, 7, 1]],  # query heads of one key/value head with different windows
        [[4, 4, 4, 4], [9, 9, 2, 2]],
        [[24, 24, 24, 24], [24, 24, 24, 24]],
    ],
)
def test_gqa_decode_equals_full_forward_float64(n_kv_head, windows):
    model = gqa_model(n_kv_head, windows, sink=3 if n_kv_head == 2 else 0)
    worst = decode_matches_forward(model, random_prompts([5, 17, 1, 11]), steps=10)
    assert worst < 1e-9


def test_gqa_decode_exact_with_banded_prefill():
    model = gqa_model(2, [[1, 16, 100, 300], [300, 37, 300, 5]], seq_len=300)
    assert {p.kind for p in model.attention_plans(320)} == {"banded"}
    assert decode_matches_forward(model, random_prompts([260, 120, 300]), steps=4) < 1e-9


def test_gqa_cache_holds_key_value_heads_for_the_widest_window_of_each_group():
    windows = [[2, 8, 64, 64], [4, 4, 3, 16]]
    model = gqa_model(2, windows, seq_len=64)
    cache, _ = gen.prefill(model, random_prompts([50, 30]), max_new_tokens=14)  # max_len = 64
    assert cache.slots == [[8, 64], [4, 16]]  # per key/value head: the widest window of its two query heads
    assert [g.k.shape[1] for g in cache.layers[0]] == [1, 1]  # two key/value heads, one ring each
    d = model.cfg.head_dim
    assert cache.nbytes == gen.cache_bytes(windows, 64, d, batch=2, dtype=torch.float64, n_kv_head=2)
    assert cache.nbytes == (8 + 64 + 4 + 16) * d * 2 * 8 * 2  # float64, batch 2


def test_kv_bytes_per_token_against_full_attention():
    """KV-cache bytes per token of context in generation, measured on the cache (fp32, context T = prompt + new
    tokens), for full attention and a window table, with one key/value head per query head, two groups and one
    (printed, with the share of the full multi-head cache)."""
    T, D = 64, 8
    windows = [[4, 8, 64, 16], [64, 4, 4, 4]]
    per_token = {}
    for n_kv in (4, 2, 1):
        for name, table in (("full", [[T] * 4] * 2), ("windows", windows)):
            model = gqa_model(n_kv, table, seq_len=T).float()
            cache, _ = gen.prefill(model, random_prompts([T - 16]), max_new_tokens=16)
            assert cache.nbytes == gen.cache_bytes(table, T, D, n_kv_head=n_kv)
            per_token[n_kv, name] = cache.nbytes / T
    full = per_token[4, "full"]
    print(
        "\n".join(
            f"n_kv_head={n} {name:8s} {b:7.1f} B/token {b / full:.3f} of full MHA" for (n, name), b in per_token.items()
        )
    )
    assert full == gen.full_cache_bytes(2, 4, T, D) / T == 2 * 4 * D * 2 * 4  # layers x heads x D x (k, v) x fp32
    assert per_token[2, "full"] == full / 2 and per_token[1, "full"] == full / 4
    # windows: MHA keeps each head's own window; GQA each key/value head its group's widest
    assert per_token[4, "windows"] == sum(map(sum, windows)) * D * 2 * 4 / T
    assert per_token[2, "windows"] == (8 + 64 + 64 + 4) * D * 2 * 4 / T
    assert per_token[1, "windows"] == (64 + 64) * D * 2 * 4 / T == per_token[1, "full"]  # one wide head: no saving
