"""A tiny Llama written as a GGUF file with the gguf package's own writer, as llama.cpp's converter writes one: the
metadata keys, the q and k rows reordered for llama.cpp's RoPE, and a byte-level BPE tokenizer (trained here on a few
sentences) in the metadata. Nothing is downloaded."""

from __future__ import annotations

import json

import numpy as np

from helpers.hf_models import T, tiny

TEXT = (
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs.\n",
    "for i in range(10):\n    print(i, fib(i))\n",
)
EOD = "<|endoftext|>"
VOCAB = 300  # one end-of-document token, the 256 bytes, and the merges the trainer learns up to this size


def byte_level_bpe():
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``VOCAB`` ids, ``EOD`` first, trained on ``TEXT``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split, as transformers reads gpt2
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXT * 20, trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def _llama_cpp_order(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter reorders each head's q / k rows from rotate-half pairs to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, seed: int = 0, tokenizer: bool = True, extra=None):
    """A tiny Llama (2 layers, 4 query heads, 2 key/value heads, d = 32, untied, vocabulary ``VOCAB``, context ``T``)
    with random weights, written to ``path`` as a float32 GGUF file with its tokenizer (unless ``tokenizer`` is
    False); ``extra(writer)`` adds to it. Returns the transformers model whose weights the file holds."""
    import gguf

    model = tiny("llama3", seed, vocab_size=VOCAB, rope_theta=10000.0, rope_scaling=None)
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    tok = byte_level_bpe()
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    merges = json.loads(tok.to_str())["model"]["merges"]  # ["a b", ...], or [["a", "b"], ...] in newer tokenizers

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny llama")
    w.add_context_length(T)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(VOCAB)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    if tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list([token for token, _ in vocab])
        w.add_token_types([gguf.TokenType.CONTROL if token == EOD else gguf.TokenType.NORMAL for token, _ in vocab])
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        w.add_bos_token_id(tok.token_to_id(EOD))
        w.add_eos_token_id(tok.token_to_id(EOD))

    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        hf = f"model.layers.{i}."
        for theirs, ours in (
            ("input_layernorm", "attn_norm"),
            ("self_attn.v_proj", "attn_v"),
            ("self_attn.o_proj", "attn_output"),
            ("post_attention_layernorm", "ffn_norm"),
            ("mlp.gate_proj", "ffn_gate"),
            ("mlp.up_proj", "ffn_up"),
            ("mlp.down_proj", "ffn_down"),
        ):
            w.add_tensor(f"blk.{i}.{ours}.weight", state[f"{hf}{theirs}.weight"])
        w.add_tensor(
            f"blk.{i}.attn_q.weight", _llama_cpp_order(state[hf + "self_attn.q_proj.weight"], cfg.num_attention_heads)
        )
        w.add_tensor(
            f"blk.{i}.attn_k.weight", _llama_cpp_order(state[hf + "self_attn.k_proj.weight"], cfg.num_key_value_heads)
        )
    w.add_tensor("output_norm.weight", state["model.norm.weight"])
    w.add_tensor("output.weight", state["lm_head.weight"])
    if extra is not None:
        extra(w)
    w.write_header_to_file()  # the writer's documented order: header, metadata, tensors
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model
