"""Continue one prompt from a checkpoint: the quick form of ``aah predict``.

    python tools/generate.py CKPT --prompt "def fib(" --max-new-tokens 200
    python tools/generate.py CKPT --prompt "import " --temperature 0.8 --top-k 40 --top-p 0.95 --seed 1

The model's shape and window table come from the checkpoint, the tokenizer from the data settings it was trained
with (``--tokenizer`` overrides). Prints the prompt and its continuation; the token counts, the KV cache size and the
speed go to stderr. For many prompts, JSON Lines output or several GPUs use ``aah predict`` (docs/generation.md).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from aah_lightning.checkpoint import load_model
from aah_lightning.data.prompts import encode_prompt
from aah_lightning.errors import ConfigError
from aah_lightning.inputs import available_devices, torch_device
from aah_lightning.model import generate as gen


def load(path: str, tokenizer: str | None, device, weights_only: bool):
    """The GPT of a Lightning checkpoint (eval mode, on ``device``) and its tokenizer."""
    model, tok = load_model(
        path,
        device,
        tokenizer=tokenizer,
        weights_only=weights_only,
        setting="ckpt_path",
        tokenizer_setting="--tokenizer",
    )
    if tok is None:
        raise ConfigError(
            f"ckpt_path={path!r} holds a model of token ids (data.source synthetic or recall), not of text: pass the "
            f"--tokenizer its ids belong to"
        )
    return model, tok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("ckpt", help="a checkpoint written by aah fit (e.g. runs/quickstart/checkpoints/last.ckpt)")
    p.add_argument("--prompt", default="", help="the text to continue (default: start a new document)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stop-at-eod", action="store_true", help="keep going past the end-of-document token")
    p.add_argument("--tokenizer", default=None, help="override the checkpoint's data.tokenizer")
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help=f"cpu, cuda, cuda:N or mps (here: {available_devices()}); default: cuda if there is one",
    )
    p.add_argument(
        "--weights-only",
        default="true",
        choices=["true", "false"],
        help="false: also unpickle objects other than tensors (only for files you trust)",
    )
    args = p.parse_args(argv)
    try:
        cfg = gen.GenerationConfig(
            args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, not args.no_stop_at_eod
        )
        cfg.validate(name=lambda field: "--" + field.replace("_", "-"))
        device = torch_device(args.device, "--device")  # before the checkpoint is read
        model, tok = load(args.ckpt, args.tokenizer, device, args.weights_only == "true")
    except ConfigError as e:
        print(f"generate: error: {e}", file=sys.stderr)
        return 2
    ids, dropped = encode_prompt(args.prompt, tok, model.cfg.seq_len)
    if dropped:
        print(
            f"generate: warning: the prompt's first {dropped} tokens are dropped (the model takes {model.cfg.seq_len})",
            file=sys.stderr,
        )
    start = time.perf_counter()
    out = gen.generate(model, [ids], cfg, tok.eos_id)[0]
    seconds = time.perf_counter() - start
    print(args.prompt + tok.decode(out.tokens), flush=True)
    total = len(ids) + cfg.max_new_tokens
    c = model.cfg
    dtype = next(model.parameters()).dtype
    cache = gen.cache_bytes(
        model.windows.tolist(), total, c.head_dim, dtype=dtype, n_kv_head=c.kv_heads, sink=model.sink
    )
    full = gen.full_cache_bytes(c.n_layer, c.kv_heads, total, c.head_dim, dtype=dtype)
    print(
        f"[{len(ids) - 1} prompt tokens, {len(out.tokens)} new ({out.stop}), {len(out.tokens) / seconds:.0f} "
        f"tokens/s; KV cache {cache / 2**10:.0f} KiB = {cache / full:.3f} of a full cache]",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
