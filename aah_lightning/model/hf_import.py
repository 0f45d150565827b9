"""Hugging Face Llama-family checkpoints as aah GPTs: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and
Qwen3ForCausalLM, read from a folder of ``config.json`` and safetensors weights (``model.safetensors``, or shards
listed in ``model.safetensors.index.json``), without transformers.

* ``gpt_config(hf)``: the ``GPTConfig`` of a ``config.json`` (GQA, SwiGLU, RMSNorm, tied or untied output, Qwen2's
  q/k/v biases, Qwen3's q/k norm and head size, RoPE base and its linear / llama3 scaling);
* ``window_table(hf, cfg)``: the windows the model was trained with: every head full, except Mistral's
  ``sliding_window`` (every layer) and the layers ``layer_types`` marks ``sliding_attention`` (Qwen2 / Qwen3 with
  ``use_sliding_window``), whose heads keep that window;
* ``gpt_state_dict(weights, cfg)``: the weights renamed and fused into aah's layout (q, k, v rows concatenated into
  ``attn.qkv``); Hugging Face's rotate-half RoPE is aah's, so no weight is permuted;
* ``import_folder(folder)``: all of it, a GPT in eval mode with its window table.

A GGUF file (llama.cpp's format) of the same families is read through transformers' GGUF loader, which dequantises
its weights to float32 and rebuilds its config and tokenizer from the file's metadata (the 'gguf' extra):
``read_gguf_config``, ``read_gguf_weights`` and ``read_gguf_tokenizer`` give what a folder's files give, and
``import_gguf(path)`` the GPT; the mappings above are the same.

Whatever does not fit is one ``ConfigError`` line naming the folder (or file) and the unsupported family or feature,
the missing file or weight, or the weight whose shape differs from what ``config.json`` says.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor

from aah_lightning.errors import ConfigError
from aah_lightning.extras import need
from aah_lightning.inputs import first_line
from aah_lightning.model.config import GPTConfig
from aah_lightning.model.gpt import GPT

FAMILIES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
# What every supported config.json states (the rest has defaults).
REQUIRED = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
)
# Buffers some checkpoints carry that aah computes itself.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# A GGUF file starts with these bytes; its general.architecture (transformers' model_type) names the family.
GGUF_MAGIC = b"GGUF"
GGUF_FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",  # transformers' name for a llama file whose general.name says mistral
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
GGUF_EXTRA = "gguf"
# What reading a GGUF file imports: the 'gguf' extra installs them all, so a missing one names that extra.
GGUF_PACKAGES = ("transformers", "tokenizers", "gguf", "accelerate")


def read_config(folder) -> dict:
    """The folder's ``config.json`` as a dict."""
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise ConfigError(f"{folder}: no {CONFIG_FILE}: not a Hugging Face model folder")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable JSON config ({type(e).__name__})") from None


def family(hf: Mapping, where="config.json") -> str:
    """The model class of a config, one of ``FAMILIES``."""
    names = list(hf.get("architectures") or [])
    if len(names) != 1 or names[0] not in FAMILIES:
        raise ConfigError(f"{where}: architectures={names}: unsupported family; aah imports {', '.join(FAMILIES)}")
    return names[0]


def _refuse(where, setting: str, value, why: str):
    raise ConfigError(f"{where}: {setting}={value!r} is not supported: {why}")


def rope_settings(hf: Mapping, where="config.json") -> dict:
    """RoPE's ``GPTConfig`` settings: base and scaling, from ``rope_parameters`` (transformers 5) or ``rope_theta`` and
    ``rope_scaling`` (earlier)."""
    params = dict(hf.get("rope_parameters") or {})
    scaling = dict(hf.get("rope_scaling") or {}) or params
    base = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        _refuse(where, "partial_rotary_factor", partial, "aah rotates every channel of a head")
    settings = {"rope_base": float(base)}
    if kind == "default":
        return settings
    if kind not in ("linear", "llama3"):
        _refuse(where, "rope_scaling.rope_type", kind, "aah supports default, linear and llama3")
    settings |= {"rope_scaling": kind, "rope_factor": float(scaling["factor"])}
    if kind == "llama3":
        settings |= {
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_seq_len": int(scaling["original_max_position_embeddings"]),
        }
    return settings


def gpt_config(hf: Mapping, seq_len: int | None = None, backend: str = "auto", where="config.json") -> GPTConfig:
    """The ``GPTConfig`` of a Hugging Face ``config.json``; ``seq_len`` defaults to its ``max_position_embeddings``."""
    name = family(hf, where)
    missing = [k for k in REQUIRED if k not in hf and not (k == "max_position_embeddings" and seq_len)]
    if missing:
        raise ConfigError(f"{where}: no {', '.join(missing)}: not a complete {name} config")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        _refuse(where, "hidden_act", act, "the Llama family's MLP is SwiGLU (silu)")
    for setting in ("attention_bias", "mlp_bias"):  # a bias on o_proj or the MLP: not these families' layout
        if hf.get(setting) and name != "Qwen2ForCausalLM":
            _refuse(where, setting, hf[setting], "aah's Llama layout has biases on q, k, v only")
    n_embd, n_head = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or n_embd // n_head
    n_kv = int(hf.get("num_key_value_heads") or n_head)
    return GPTConfig(
        vocab_size=int(hf["vocab_size"]),
        seq_len=int(seq_len or hf["max_position_embeddings"]),
        n_layer=int(hf["num_hidden_layers"]),
        n_head=n_head,
        n_kv_head=None if n_kv == n_head else n_kv,  # as a config of aah's would say it
        n_embd=n_embd,
        head_size=None if head_dim * n_head == n_embd else int(head_dim),
        mlp="swiglu",
        mlp_hidden=int(hf["intermediate_size"]),
        norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        qkv_bias=name == "Qwen2ForCausalLM",  # Qwen2: q, k, v biases, none on o
        qk_norm=name == "Qwen3ForCausalLM",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        backend=backend,
        **rope_settings(hf, where),
    )


def window_table(hf: Mapping, cfg: GPTConfig, where="config.json") -> Tensor:
    """The model's own windows ``[n_layer, n_head]``: ``seq_len`` (full), or ``sliding_window`` on the layers that
    slide (Mistral: every layer; Qwen2 / Qwen3 with ``use_sliding_window``: those ``layer_types`` marks, or in configs
    without it the layers from ``max_window_layers`` on)."""
    table = torch.full((cfg.n_layer, cfg.n_head), cfg.seq_len, dtype=torch.int32)
    window = hf.get("sliding_window")
    kinds = hf.get("layer_types")
    if family(hf, where) == "MistralForCausalLM":
        kinds = ["sliding_attention"] * cfg.n_layer
    elif not hf.get("use_sliding_window", False):
        return table
    if not kinds:  # configs written before layer_types: the layers from max_window_layers on slide
        first = int(hf.get("max_window_layers", 0))
        kinds = ["full_attention" if layer < first else "sliding_attention" for layer in range(cfg.n_layer)]
    for layer, kind in enumerate(kinds):
        if kind not in ("full_attention", "sliding_attention"):
            _refuse(where, f"layer_types[{layer}]", kind, "aah knows full_attention and sliding_attention")
        if kind == "sliding_attention" and window:
            table[layer] = int(window)  # HF's sliding window: query q sees keys q - W < kv <= q, aah's W
    return table


def read_weights(folder) -> dict[str, Tensor]:
    """Every tensor of the folder's safetensors file(s)."""
    load_file = need("safetensors.torch", "reading a Hugging Face folder's weights").load_file

    folder = Path(folder)
    if (folder / INDEX_FILE).is_file():
        shards = sorted(set(json.loads((folder / INDEX_FILE).read_text())["weight_map"].values()))
    elif (folder / WEIGHTS_FILE).is_file():
        shards = [WEIGHTS_FILE]
    else:
        raise ConfigError(f"{folder}: no {WEIGHTS_FILE} or {INDEX_FILE}: aah reads safetensors weights")
    weights = {}
    for shard in shards:
        if not (folder / shard).is_file():
            raise ConfigError(f"{folder}: the shard {shard} that {INDEX_FILE} lists is missing")
        try:
            weights.update(load_file(folder / shard))
        except Exception as e:  # safetensors' SafetensorError: a truncated or foreign file
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            raise ConfigError(f"{folder / shard}: not a readable safetensors file ({reason})") from None
    return weights


def gpt_state_dict(weights: Mapping[str, Tensor], cfg: GPTConfig, where="weights") -> dict[str, Tensor]:
    """The Hugging Face ``weights`` in aah's names and layout (without the window table)."""
    left = {k: v for k, v in weights.items() if not k.endswith(IGNORED_SUFFIXES)}

    def take(name: str) -> Tensor:
        if name not in left:
            raise ConfigError(f"{where}: the weight {name} is missing")
        return left.pop(name)

    out = {"wte.weight": take("model.embed_tokens.weight")}
    for i in range(cfg.n_layer):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        attn = hf + "self_attn."
        out[ours + "ln1.weight"] = take(hf + "input_layernorm.weight")
        out[ours + "attn.qkv.weight"] = torch.cat([take(f"{attn}{p}_proj.weight") for p in "qkv"])
        if cfg.qkv_bias:
            out[ours + "attn.qkv.bias"] = torch.cat([take(f"{attn}{p}_proj.bias") for p in "qkv"])
        out[ours + "attn.proj.weight"] = take(attn + "o_proj.weight")
        if cfg.qk_norm:
            out[ours + "attn.q_norm.weight"] = take(attn + "q_norm.weight")
            out[ours + "attn.k_norm.weight"] = take(attn + "k_norm.weight")
        out[ours + "ln2.weight"] = take(hf + "post_attention_layernorm.weight")
        for theirs, mine in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "proj")):
            out[f"{ours}mlp.{mine}.weight"] = take(f"{hf}mlp.{theirs}.weight")
    out["ln_f.weight"] = take("model.norm.weight")
    if cfg.tie_embeddings:
        left.pop("lm_head.weight", None)  # a tied copy some checkpoints save anyway
        out["lm_head.weight"] = out["wte.weight"]
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    if left:
        names = sorted(left)
        raise ConfigError(f"{where}: unexpected weights {names[:3]}{' ...' if len(names) > 3 else ''}")
    return out


def import_folder(folder, seq_len: int | None = None, backend: str = "auto", hf: Mapping | None = None) -> GPT:
    """The GPT of a Hugging Face folder, in eval mode on the CPU in float32, with the model's own windows (``hf``:
    its config.json already read)."""
    hf = read_config(folder) if hf is None else hf
    cfg = gpt_config(hf, seq_len, backend, f"{folder}/{CONFIG_FILE}")
    return _gpt(hf, cfg, read_weights(folder), str(folder), f"{folder}/{CONFIG_FILE}", CONFIG_FILE)


def _gpt(hf: Mapping, cfg: GPTConfig, weights: Mapping[str, Tensor], where: str, config_where: str, says: str) -> GPT:
    """The GPT of ``cfg`` with the Hugging Face ``weights`` and the model's own windows, in eval mode, float32
    (``says``: what gave the config, in the line that refuses a weight of another shape)."""
    state = gpt_state_dict(weights, cfg, where)
    model = GPT(cfg)
    expected = model.state_dict()
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ConfigError(
                f"{where}: the weight {name} has shape {tuple(tensor.shape)}, {says} says "
                f"{tuple(expected[name].shape)}: the config and the weights disagree"
            )
    state["windows"] = window_table(hf, cfg, config_where)
    model.load_state_dict({k: v.float() for k, v in state.items() if k != "windows"} | {"windows": state["windows"]})
    return model.eval()


# -- GGUF files --------------------------------------------------------------------------------------------------------
def is_gguf(path) -> bool:
    """A file that starts as a GGUF file does (the suffix is not needed)."""
    try:
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:  # a folder, a missing or unreadable file
        return False


def _gguf_reader(path, purpose: str):
    """transformers, with every package its GGUF loader needs (one line naming the 'gguf' extra if one is missing),
    and the file as transformers addresses it: its folder and its name."""
    for module in GGUF_PACKAGES:
        need(module, purpose, extra=GGUF_EXTRA)
    import transformers

    path = Path(path).resolve()
    return transformers, str(path.parent), path.name


def read_gguf_config(path) -> dict:
    """The ``config.json`` of a GGUF file as transformers rebuilds it from the metadata, with the ``architectures``
    its ``general.architecture`` names (transformers' GGUF config has none)."""
    transformers, folder, name = _gguf_reader(path, f"reading the GGUF file {path}")
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its guesses about a foreign file: aah refuses such a file in one line
    try:
        hf = transformers.AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True).to_dict()
    except Exception as e:  # gguf's and transformers' readers raise what they meet: a truncated file, a foreign one
        raise ConfigError(f"{path}: transformers' GGUF loader cannot read it ({first_line(e)})") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
    kind = hf.get("model_type")
    if kind not in GGUF_FAMILIES:
        raise ConfigError(
            f"{path}: general.architecture={kind!r} is not supported: aah imports GGUF files of "
            f"{', '.join(GGUF_FAMILIES)} ({', '.join(GGUF_FAMILIES.values())})"
        )
    _refuse_rope_scaling(path)
    return {**hf, "architectures": [GGUF_FAMILIES[kind]]}


def _refuse_rope_scaling(path) -> None:
    """transformers' GGUF config of these families reads no RoPE scaling (``<arch>.rope.scaling.*``, or Llama 3.1's
    ``rope_freqs`` tensor), so a model that has it would be imported, like transformers loads it, without it."""
    reader = need("gguf", f"reading the GGUF file {path}", extra=GGUF_EXTRA).GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    field = reader.fields.get(f"{arch}.rope.scaling.type")
    scaling = bytes(field.parts[-1]).decode() if field is not None else "none"
    if scaling != "none" or any(t.name == "rope_freqs.weight" for t in reader.tensors):
        what = f"{arch}.rope.scaling.type={scaling!r}" if scaling != "none" else "a rope_freqs tensor (llama3 scaling)"
        raise ConfigError(
            f"{path}: {what} is not supported: transformers' GGUF loader does not read RoPE scaling, so the model "
            f"would lose it; import the model's Hugging Face folder instead"
        )


def read_gguf_weights(path, hf: Mapping) -> dict[str, Tensor]:
    """Every weight of a GGUF file in Hugging Face's names, dequantised to float32 by transformers (which also undoes
    llama.cpp's reordering of the q and k rows); ``hf``: its config from ``read_gguf_config``."""
    transformers, folder, name = _gguf_reader(path, f"reading the GGUF file {path}")
    # transformers 4.56 renamed from_pretrained's torch_dtype to dtype (5.x warns on the old name)
    old = tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (4, 56)
    dtype = {"torch_dtype" if old else "dtype": torch.float32}
    try:
        model = getattr(transformers, family(hf, str(path))).from_pretrained(
            folder, gguf_file=name, local_files_only=True, **dtype
        )
    except Exception as e:
        raise ConfigError(f"{path}: its weights could not be read by transformers ({first_line(e)})") from None
    return dict(model.state_dict())


def read_gguf_tokenizer(path) -> str:
    """The tokenizer a GGUF file holds in its metadata, as transformers builds it, as ``tokenizer.json`` text."""
    transformers, folder, name = _gguf_reader(path, f"reading the GGUF file {path}")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        return tok.backend_tokenizer.to_str()
    except Exception as e:  # no tokenizer.ggml.* metadata, or a kind transformers cannot build
        raise ConfigError(
            f"{path}: no tokenizer transformers can build from its metadata ({first_line(e)}): pass --tokenizer "
            f"(a tokenizer.json or hub name)"
        ) from None


def import_gguf(path, seq_len: int | None = None, backend: str = "auto", hf: Mapping | None = None) -> GPT:
    """The GPT of a GGUF file, as ``import_folder`` gives a folder's (``hf``: its config already read)."""
    hf = read_gguf_config(path) if hf is None else hf
    cfg = gpt_config(hf, seq_len, backend, str(path))
    return _gpt(hf, cfg, read_gguf_weights(path, hf), str(path), str(path), "its metadata")
