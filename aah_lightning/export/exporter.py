"""``aah export``: a checkpoint of ``aah fit`` -> a folder that Hugging Face transformers loads.

    aah export --ckpt_path runs/quickstart/checkpoints/last.ckpt --out exports/quickstart

The folder holds ``config.json`` (the shape and the window table), ``model.safetensors`` (the weights, no pickles),
the modeling code (``modeling_aah.py``, ``configuration_aah.py``: transformers and torch only), ``generation_config.json``,
the tokenizer (``tokenizer.json``, ``tokenizer_config.json``: loads without remote code) and a model card
(``README.md``). Load it with ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``.

Everything is read and checked before anything is written: the checkpoint is verified (complete archive, matching
checksums) and unpickled weights-only, as everywhere in aah; an existing non-empty ``--out`` is refused. The folder is
written under a temporary name next to ``--out`` and renamed into place at the end, so an interrupted export leaves
no half-written folder behind, and a failed one nothing at all. Reading and writing a large model show progress
(``aah_lightning.progress``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import dataclass

import torch

from aah_lightning.atomic import new_folders, partial_name, publish_folder, remove_stale_partials, write_error
from aah_lightning.checkpoint import (
    MODEL_PREFIX,
    WINDOWS_STATE_KEY,
    build_model,
    data_settings,
    gpt_state,
    has_text_tokenizer,
    read_checkpoint,
)
from aah_lightning.errors import ConfigError
from aah_lightning.export import model_card
from aah_lightning.export.tokenizer import TokenizerExport, prepare_tokenizer
from aah_lightning.extras import need
from aah_lightning.model.config import GPTConfig
from aah_lightning.progress import stage

HF_CODE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hf_code")
CODE_FILES = ("configuration_aah.py", "modeling_aah.py")
AUTO_MAP = {
    "AutoConfig": "configuration_aah.AAHTransformersConfig",
    "AutoModel": "modeling_aah.AAHModel",
    "AutoModelForCausalLM": "modeling_aah.AAHForCausalLM",
}


def _needs_transformers():
    for module in ("safetensors.torch", "transformers", "tokenizers"):
        need(module, "aah export")


@dataclass
class ExportPlan:
    """Everything an export writes, read and checked, in memory."""

    ckpt_path: str
    config: object  # AAHTransformersConfig (the exported model's transformers config)
    tensors: dict[str, torch.Tensor]
    tokenizer: TokenizerExport | None
    card: str
    data_source: str = "stdlib"  # data.source: what a model without a tokenizer was trained on


def check_out(out: str) -> None:
    """``out`` may be written: it does not exist (its parent is created), or is an empty folder."""
    if os.path.isfile(out) or (os.path.exists(out) and not os.path.isdir(out)):
        raise ConfigError(f"--out={out!r} is a file: name a new folder to export into")
    if os.path.isdir(out) and os.listdir(out):
        raise ConfigError(f"--out={out!r} exists and is not empty: name a new or empty folder (nothing was written)")
    parent = os.path.dirname(os.path.abspath(out))
    existing = parent
    while not os.path.isdir(existing):
        if os.path.exists(existing):  # a file where a folder above out would have to be
            raise ConfigError(f"--out={out!r} cannot be created: {existing} is a file, not a folder")
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--out={out!r} cannot be created: {existing} is not writable")


# The exported model (modeling_aah.AAHForCausalLM, base_model_prefix "model") names its GPT's weights with this
# prefix: transformers' own convention, which happens to be the string of the LightningModule's checkpoint.MODEL_PREFIX.
HF_MODEL_PREFIX = "model."


def hf_weights(gpt_state: dict, tied: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A GPT's own state dict (``GPT.state_dict()``, ``checkpoint.gpt_state``) as the exported model names it, and its
    window table. A tied output layer is the embedding matrix, so it is not stored twice; an untied one (``tied``
    False) is the exported model's ``lm_head.weight``."""
    windows = gpt_state.get("windows")
    if windows is None or "wte.weight" not in gpt_state:
        raise ValueError(
            f"no GPT weights or window table ({MODEL_PREFIX}wte.weight, {WINDOWS_STATE_KEY}) in the state dict"
        )
    weights = {HF_MODEL_PREFIX + k: v for k, v in gpt_state.items() if k not in ("windows", "lm_head.weight")}
    if not tied:
        weights["lm_head.weight"] = gpt_state["lm_head.weight"]
    return weights, windows


def model_state(state_dict: dict, tied: bool = True) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The GPT's weights from a LightningModule state dict (compiled blocks' ``_orig_mod.`` dropped), named as the
    exported model names them, and its window table (``hf_weights``)."""
    return hf_weights(gpt_state(state_dict), tied)


# GPTConfig's RoPE scaling as the exported config names it (configuration_aah.py: transformers rewrites configs that
# carry its own rope_scaling / rope_theta, so the names are aah's).
_ROPE_FIELDS = {
    "rope_scaling": "rope_scaling_type",
    "rope_factor": "rope_factor",
    "rope_low_freq_factor": "rope_low_freq_factor",
    "rope_high_freq_factor": "rope_high_freq_factor",
    "rope_original_seq_len": "rope_original_max_position_embeddings",
}


def hf_config(gpt: GPTConfig, windows: torch.Tensor, eod_id: int, sink: int = 0):
    """The exported model's config: ``gpt``'s shape (the Llama family's settings included), the window table, the
    attention sink (``model.aah.sink``) and the special tokens."""
    from aah_lightning.export.hf_code.configuration_aah import AAHTransformersConfig

    config = AAHTransformersConfig(
        vocab_size=gpt.vocab_size,
        hidden_size=gpt.n_embd,
        num_hidden_layers=gpt.n_layer,
        num_attention_heads=gpt.n_head,
        num_key_value_heads=gpt.kv_heads,
        head_dim=gpt.head_dim,
        intermediate_size=gpt.mlp_width,
        mlp=gpt.mlp,
        norm=gpt.norm,
        layer_norm_eps=float(gpt.norm_eps),
        qkv_bias=gpt.qkv_bias,
        qk_norm=gpt.qk_norm,
        tie_word_embeddings=gpt.tie_embeddings,
        max_position_embeddings=gpt.seq_len,
        rope_base=float(gpt.rope_base),
        **{theirs: getattr(gpt, ours) for ours, theirs in _ROPE_FIELDS.items()},
        bias=gpt.bias,
        windows=windows.tolist(),
        sink=sink,
        document_mask=gpt.document_mask,
        bos_token_id=eod_id,
        eos_token_id=eod_id,
        pad_token_id=eod_id,
    )
    config.architectures = ["AAHForCausalLM"]
    config.auto_map = dict(AUTO_MAP)
    return config


def prepare(
    ckpt_path: str,
    tokenizer: str | None = None,
    weights_only: bool = True,
    out: str = "PATH",
    bench: str | None = None,
) -> ExportPlan:
    """Read and check everything an export needs (``out``: the folder the model card's snippet loads; ``bench``: a
    ``tools/bench_decode.py --json`` record of this checkpoint, for the card); writes nothing. Raises
    ``ConfigError`` with one line."""
    _needs_transformers()
    if not os.path.exists(ckpt_path):
        raise ConfigError(
            f"--ckpt_path={ckpt_path!r} does not exist: pass a checkpoint file written by aah fit "
            f"(e.g. runs/quickstart/checkpoints/last.ckpt)"
        )
    with stage(f"reading {ckpt_path}"):
        ckpt = read_checkpoint(ckpt_path, weights_only=weights_only, setting="--ckpt_path")
        record = model_card.read_bench(bench, ckpt_path) if bench is not None else None
        aah_model = build_model(ckpt, ckpt_path, setting="--ckpt_path")  # the GPT with its weights and window table
    gpt, data = aah_model.cfg, data_settings(ckpt)
    weights, windows = hf_weights(aah_model.state_dict(), tied=gpt.tie_embeddings)

    tok = None
    if has_text_tokenizer(data, tokenizer):  # not for a model of token ids (the synthetic and recall tasks)
        setting = "--tokenizer" if tokenizer is not None else "data.tokenizer"  # the one the user gave
        tok = prepare_tokenizer(tokenizer or data.get("tokenizer", "byte"), gpt.vocab_size, setting)
    eod_id = (
        tok.eod_id if tok is not None else gpt.vocab_size - 1
    )  # token ids: the last id (synthetic: after the symbols)
    config = hf_config(gpt, windows, eod_id, aah_model.sink)

    from aah_lightning.export.hf_code.modeling_aah import AAHForCausalLM

    model = AAHForCausalLM(config)
    try:
        loaded = model.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # the transformers model names or shapes a weight otherwise than aah's GPT
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise ConfigError(
            f"--ckpt_path={ckpt_path!r}: its weights do not match its hyperparameters ({lines[-1][:200]})"
        ) from e
    if loaded.missing_keys or loaded.unexpected_keys:
        raise ConfigError(
            f"--ckpt_path={ckpt_path!r}: its weights do not match its hyperparameters (missing "
            f"{loaded.missing_keys[:3]}, unexpected {loaded.unexpected_keys[:3]})"
        )
    tensors = {k: v.detach().contiguous() for k, v in weights.items()}  # the rebuilt GPT's own tensors: no copy
    # The weights' dtype in config.json ("dtype"; "torch_dtype" before transformers 4.56), as transformers writes it.
    dtype = next(iter(tensors.values())).dtype
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", dtype)
    params = sum(t.numel() for t in tensors.values())
    card = model_card.render(ckpt_path, ckpt, gpt, windows, tok, data, params, out, dtype, aah_model.sink, record)
    return ExportPlan(ckpt_path, config, tensors, tok, card, data.get("source", "stdlib"))


def _drop_attention_choice(path: str) -> None:
    """Remove what building the model here decided about its attention from config.json: transformers 4.5x writes
    ``_attn_implementation_autoset: true`` and, reading it back, then skips choosing SDPA (the default) for the
    loaded model."""
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    dropped = [config.pop(key) for key in ("_attn_implementation_autoset", "_attn_implementation") if key in config]
    if dropped:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")


def write(plan: ExportPlan, out: str) -> None:
    """Write ``plan`` to a temporary folder next to ``out``, then rename it to ``out``. A failed write leaves nothing:
    not the temporary folder, nor the folders made for ``out`` (a killed one's temporary folder is removed by the
    next export beside it)."""
    check_out(out)
    out = os.path.abspath(out)
    with new_folders(os.path.dirname(out)), stage(f"writing {out}"):
        _write_folder(plan, out)


def _write_folder(plan: ExportPlan, out: str) -> None:
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    parent = os.path.dirname(out)
    remove_stale_partials(parent)  # what exports killed on this host left
    tmp = os.path.join(parent, partial_name())
    os.makedirs(tmp)
    try:
        plan.config.save_pretrained(tmp)
        _drop_attention_choice(os.path.join(tmp, "config.json"))
        eod = plan.config.eos_token_id
        GenerationConfig(bos_token_id=eod, eos_token_id=eod, pad_token_id=eod).save_pretrained(tmp)
        weights = os.path.join(tmp, "model.safetensors")
        save_file(plan.tensors, weights, metadata={"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(weights, 0o666 & ~umask)  # safetensors creates it owner-only; like the other files instead
        for name in CODE_FILES:
            shutil.copyfile(os.path.join(HF_CODE, name), os.path.join(tmp, name))
        if plan.tokenizer is not None:
            plan.tokenizer.save(tmp, plan.config.max_position_embeddings)
        with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
            f.write(plan.card)
        if os.path.isdir(out):  # an empty folder (check_out): replaced by the finished one
            os.rmdir(out)
        publish_folder(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        needed = sum(t.numel() * t.element_size() for t in plan.tensors.values())
        failed = write_error(e, out, parent, needed, what="export")  # OSError, or safetensors' own error
        if failed is not None:
            raise ConfigError(
                f"--out={out!r} could not be written: {failed.reason}; nothing was left there: free space there or "
                f"choose another --out"
            ) from e
        raise


def export(
    ckpt_path: str, out: str, tokenizer: str | None = None, weights_only: bool = True, bench: str | None = None
) -> ExportPlan:
    """Export checkpoint ``ckpt_path`` to folder ``out``; returns what was written."""
    check_out(out)  # before the checkpoint is read: a refused folder costs nothing
    plan = prepare(ckpt_path, tokenizer, weights_only, out, bench)
    write(plan, out)
    return plan


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="aah export",
        description="Export a checkpoint of aah fit as a Hugging Face transformers folder "
        "(AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True), AutoTokenizer.from_pretrained(DIR)).",
    )
    p.add_argument("--ckpt_path", required=True, help="a checkpoint file written by aah fit (e.g. .../last.ckpt)")
    p.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="the tokenizer to ship: 'byte' or a Hugging Face tokenizer name, tokenizer.json or folder "
        "(default: the checkpoint's data.tokenizer)",
    )
    p.add_argument(
        "--weights_only",
        default="true",
        choices=["true", "false"],
        help="false: also unpickle objects other than tensors (only for checkpoints you trust)",
    )
    p.add_argument(
        "--bench",
        default=None,
        help="a record of tools/bench_decode.py --checkpoint CKPT --windows checkpoint --json FILE, measured on this "
        "checkpoint: the model card states its decoding speed and memory",
    )
    args = p.parse_args(argv)
    try:
        plan = export(args.ckpt_path, args.out, args.tokenizer, args.weights_only == "true", args.bench)
    except ConfigError as e:
        print(f"aah export: error: {e}", file=sys.stderr)
        return 2
    c = plan.config
    tok = f"no tokenizer ({plan.data_source} data)" if plan.tokenizer is None else f"tokenizer {plan.tokenizer.spec!r}"
    params = sum(t.numel() for t in plan.tensors.values())
    print(
        f"exported {args.ckpt_path} -> {args.out}: {c.num_hidden_layers} layers x {c.num_attention_heads} heads, "
        f"d={c.hidden_size}, {params / 1e6:.2f} M parameters, trained T={c.max_position_embeddings}, {tok}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
