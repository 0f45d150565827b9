"""The checkpoint format of aah: every top-level key by name, the one verified reader, and the model of a checkpoint.

A checkpoint of ``aah fit`` is a Lightning checkpoint (a ``torch.save`` archive of one dict; under FSDP2 a folder of
shards whose plain entries are in ``meta.pt``). Its top-level keys, who writes them and what they hold (``KEYS`` is
this table in code, ``keys_table()`` prints it; docs/architecture.md, "Checkpoint keys", holds the same):

| key | constant | written by | holds |
|---|---|---|---|
| `epoch` | `EPOCH_KEY` | Lightning | the fit loop's epoch |
| `global_step` | `GLOBAL_STEP_KEY` | Lightning | optimizer steps done (inspect, the model card) |
| `pytorch-lightning_version` | `LIGHTNING_VERSION_KEY` | Lightning | the Lightning version that wrote the file |
| `state_dict` | `STATE_DICT_KEY` | Lightning: `AAHModule.state_dict()` | the GPT's weights `model.*` and the window table `model.windows` (`WINDOWS_STATE_KEY`, int32 [n_layer, n_head]); compiled blocks' names hold `_orig_mod.` |
| `loops` | `LOOPS_KEY` | Lightning | the loops' progress (exact resume) |
| `callbacks` | `CALLBACKS_KEY` | Lightning: each callback's `state_dict()` | `WindowDiagnostics`' probe sample, the checkpoint callbacks' bookkeeping |
| `optimizer_states` | `OPTIMIZER_STATES_KEY` | Lightning | AdamW's state |
| `lr_schedulers` | `LR_SCHEDULERS_KEY` | Lightning | the warmup + cosine schedule's state |
| `hparams_name` | `HPARAMS_NAME_KEY` | Lightning | how the hyperparameters were saved (`null`: as one dict; `kwargs` in the earlier flat layout) |
| `hyper_parameters` | `HYPER_PARAMETERS_KEY` | Lightning: `AAHModule.save_hyperparameters` | the `model.*` settings as plain dicts `gpt`, `aah`, `optim` and their layout's version `_format` (`HPARAMS_FORMAT_ENTRY`; `upgrade_hyperparameters` reads earlier layouts): the GPT `load_model` rebuilds |
| `datamodule_hparams_name` | `DATAMODULE_HPARAMS_NAME_KEY` | Lightning | as `hparams_name`, for the data module |
| `datamodule_hyper_parameters` | `DATAMODULE_HYPER_PARAMETERS_KEY` | Lightning: `TextDataModule.save_hyperparameters` | the `data.*` settings (`source`, `tokenizer`, ..., each source's block; `data_settings` nests the flat layout of earlier versions): the tokenizer of `load_model` and of the export |
| `TextDataModule` | `DATAMODULE_STATE_KEY` | Lightning: `TextDataModule.state_dict()`, under the class's name | the data position (`layout`; streamed data: every rank's position) |
| `aah_log_folder` | `LOG_FOLDER_KEY` | aah: `LastCheckpoint.on_save_checkpoint` (lit/last_checkpoint.py) | `{save_dir, name, version}` of the run's logger: a resumed run logs on there |
| `aah_policy` | `POLICY_KEY` | aah: `AAHModule.on_save_checkpoint` | the window policy's `state_dict()` (plain tensors, lists, ints): a resumed run decides as the uninterrupted one would; inspect rebuilds the head groups from it |
| `aah_rng` | `RNG_KEY` | aah: `AAHModule.on_save_checkpoint` | every rank's Python, NumPy, torch (CUDA) RNG states, in rank order |
| `aah_window_usage` | `WINDOW_USAGE_KEY` | aah: `AAHModule.on_save_checkpoint` | `WindowUsage.state_dict()`: `window_sum` [n_layer, n_head] (min(W, T) summed over steps), with an attention sink `sink_sum` (its pairs summed over steps), `steps`, `nonuniform_steps`: the suite's per-head ACR and share of non-uniform steps |

Every other module names a key by its constant here: ``tests/test_checkpoint.py`` checks that no other module of
the package or tool spells one out, and that this table, ``KEYS`` and the one in docs/architecture.md agree.

Reading: ``read_checkpoint`` (and ``load_checkpoint_file``, which Lightning's loads go through via
``lit/atomic_files.AtomicCheckpointIO``): the file must be a complete PyTorch archive whose CRC32 checksums match
(torch itself does not check them, so a damaged copy would load silently), and it is unpickled with
``weights_only=True`` unless the caller (the user's ``--weights_only false``) says otherwise. Every failure is a
one-line ``ConfigError`` naming the file. ``load_model`` rebuilds the GPT with its window table from the weights and
hyperparameters, and the tokenizer from the data settings; generation, inspection, the suite and the export read
checkpoints through these.

Layer: this module imports only ``errors``, ``model/`` and ``data/``, so every layer above (``windows/``, ``lit/``,
``validation``, ``export/``, ``experiments/``, the tools) may use it.
"""

from __future__ import annotations

import os
import pickle
import zipfile
import zlib
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any, Optional

import torch

from aah_lightning.data.config import nest_data_settings
from aah_lightning.data.sources import is_text
from aah_lightning.data.tokenizers import load_tokenizer
from aah_lightning.errors import ConfigError
from aah_lightning.inputs import first_line
from aah_lightning.model.config import WEIGHT_SHAPE_SETTINGS, GPTConfig
from aah_lightning.model.gpt import GPT

# -- the top-level keys ------------------------------------------------------------------------------------------------
# Written by Lightning.
EPOCH_KEY = "epoch"
GLOBAL_STEP_KEY = "global_step"
LIGHTNING_VERSION_KEY = "pytorch-lightning_version"
STATE_DICT_KEY = "state_dict"
LOOPS_KEY = "loops"
CALLBACKS_KEY = "callbacks"
OPTIMIZER_STATES_KEY = "optimizer_states"
LR_SCHEDULERS_KEY = "lr_schedulers"
HPARAMS_NAME_KEY = "hparams_name"
HYPER_PARAMETERS_KEY = "hyper_parameters"
DATAMODULE_HPARAMS_NAME_KEY = "datamodule_hparams_name"
DATAMODULE_HYPER_PARAMETERS_KEY = "datamodule_hyper_parameters"
DATAMODULE_STATE_KEY = "TextDataModule"  # Lightning names the data module's state after its class
# Written by aah.
LOG_FOLDER_KEY = "aah_log_folder"
POLICY_KEY = "aah_policy"
RNG_KEY = "aah_rng"
WINDOW_USAGE_KEY = "aah_window_usage"

# Inside ``state_dict``: the LightningModule's GPT (``AAHModule.model``) names its weights with this prefix, and its
# buffer ``windows`` is the window table.
MODEL_PREFIX = "model."
WINDOWS_STATE_KEY = MODEL_PREFIX + "windows"
# torch.compile's wrapper adds this to the names of compiled blocks' weights.
COMPILED_PREFIX = "_orig_mod."

# key -> (written by, what it holds): the table of the module docstring and of docs/architecture.md.
KEYS: dict[str, tuple[str, str]] = {
    EPOCH_KEY: ("Lightning", "the fit loop's epoch"),
    GLOBAL_STEP_KEY: ("Lightning", "optimizer steps done (inspect, the model card)"),
    LIGHTNING_VERSION_KEY: ("Lightning", "the Lightning version that wrote the file"),
    STATE_DICT_KEY: (
        "Lightning: `AAHModule.state_dict()`",
        "the GPT's weights `model.*` and the window table `model.windows` (`WINDOWS_STATE_KEY`, int32 "
        "[n_layer, n_head]); compiled blocks' names hold `_orig_mod.`",
    ),
    LOOPS_KEY: ("Lightning", "the loops' progress (exact resume)"),
    CALLBACKS_KEY: (
        "Lightning: each callback's `state_dict()`",
        "`WindowDiagnostics`' probe sample, the checkpoint callbacks' bookkeeping",
    ),
    OPTIMIZER_STATES_KEY: ("Lightning", "AdamW's state"),
    LR_SCHEDULERS_KEY: ("Lightning", "the warmup + cosine schedule's state"),
    HPARAMS_NAME_KEY: (
        "Lightning",
        "how the hyperparameters were saved (`null`: as one dict; `kwargs` in the earlier flat layout)",
    ),
    HYPER_PARAMETERS_KEY: (
        "Lightning: `AAHModule.save_hyperparameters`",
        "the `model.*` settings as plain dicts `gpt`, `aah`, `optim` and their layout's version `_format` "
        "(`HPARAMS_FORMAT_ENTRY`; `upgrade_hyperparameters` reads earlier layouts): the GPT `load_model` rebuilds",
    ),
    DATAMODULE_HPARAMS_NAME_KEY: ("Lightning", "as `hparams_name`, for the data module"),
    DATAMODULE_HYPER_PARAMETERS_KEY: (
        "Lightning: `TextDataModule.save_hyperparameters`",
        "the `data.*` settings (`source`, `tokenizer`, ..., each source's block; `data_settings` nests the flat "
        "layout of earlier versions): the tokenizer of `load_model` and of the export",
    ),
    DATAMODULE_STATE_KEY: (
        "Lightning: `TextDataModule.state_dict()`, under the class's name",
        "the data position (`layout`; streamed data: every rank's position)",
    ),
    LOG_FOLDER_KEY: (
        "aah: `LastCheckpoint.on_save_checkpoint` (lit/last_checkpoint.py)",
        "`{save_dir, name, version}` of the run's logger: a resumed run logs on there",
    ),
    POLICY_KEY: (
        "aah: `AAHModule.on_save_checkpoint`",
        "the window policy's `state_dict()` (plain tensors, lists, ints): a resumed run decides as the uninterrupted "
        "one would; inspect rebuilds the head groups from it",
    ),
    RNG_KEY: (
        "aah: `AAHModule.on_save_checkpoint`",
        "every rank's Python, NumPy, torch (CUDA) RNG states, in rank order",
    ),
    WINDOW_USAGE_KEY: (
        "aah: `AAHModule.on_save_checkpoint`",
        "`WindowUsage.state_dict()`: `window_sum` [n_layer, n_head] (min(W, T) summed over steps), with an attention "
        "sink `sink_sum` (its pairs summed over steps), `steps`, "
        "`nonuniform_steps`: the suite's per-head ACR and share of non-uniform steps",
    ),
}


def keys_table() -> str:
    """``KEYS`` as the Markdown table of the module docstring and of docs/architecture.md."""
    names = {value: name for name, value in globals().items() if name.endswith("_KEY") and isinstance(value, str)}
    rows = ["| key | constant | written by | holds |", "|---|---|---|---|"]
    rows += [f"| `{key}` | `{names[key]}` | {writer} | {holds} |" for key, (writer, holds) in KEYS.items()]
    return "\n".join(rows)


# The layout of the module's hyperparameters (inside ``hyper_parameters``, under ``HPARAMS_FORMAT_ENTRY``; a ``_`` key
# is not an argument of the module). 1 (no version saved): the GPT's settings flat next to the ``aah`` and ``optim``
# dicts, as ``--model.n_layer``; 2: one dict per settings dataclass, ``gpt``, ``aah`` and ``optim``
# (``--model.gpt.n_layer``). ``upgrade_hyperparameters`` reads every earlier layout as today's.
HPARAMS_FORMAT_ENTRY = "_format"
HPARAMS_FORMAT = 4
# Format 2 kept the simple policies' settings flat in ``aah``; format 3 moved each into its policy's block
# (``aah.fixed.window``). The same keys given flat in a config still work, with one deprecation line (AAHConfig).
FLAT_POLICY_SETTINGS = {
    "window": ("fixed",),
    "warmup_steps": ("fixed",),
    "table": ("static", "random"),
    "long_layer": ("random",),
    "redraw_interval": ("random", "shuffle"),
}
# Format 3 kept the controller's settings flat in ``aah.controller``; format 4 holds them in blocks beside the code
# that reads them (``aah.controller.budget.target_acr``). Flat key -> (block, name); the same keys given flat in a
# config still work, with one deprecation line (ControllerConfig).
FLAT_CONTROLLER_SETTINGS = {
    "signal": ("need", "signal"),
    "probe_sequences": ("need", "probe_sequences"),
    "probe_queries": ("need", "probe_queries"),
    "ema_alpha": ("need", "ema_alpha"),
    "grouping": ("groups", "method"),
    "feature_set": ("groups", "feature_set"),
    "feature_floor": ("groups", "feature_floor"),
    "metric": ("groups", "metric"),
    "threshold": ("groups", "threshold"),
    "threshold_growth": ("groups", "threshold_growth"),
    "min_group_size": ("groups", "min_group_size"),
    "max_groups": ("groups", "max_groups"),
    "hysteresis": ("groups", "hysteresis"),
    "random_groups": ("groups", "random_groups"),
    "depth": ("groups", "depth"),
    "reuse_groups": ("groups", "reuse_groups"),
    "allocator": ("allocation", "allocator"),
    "paper_joint_scorer": ("allocation", "paper_joint_scorer"),
    "coverage_target": ("allocation", "coverage_target"),
    "parent_constraint": ("allocation", "parent_constraint"),
    "target_acr": ("budget", "target_acr"),
    "target_causal_coverage": ("budget", "target_causal_coverage"),
    "budget_scope": ("budget", "scope"),
    "budget_over_run": ("budget", "over_run"),
    "explorers": ("reach", "explorers"),
    "explore_window": ("reach", "explore_window"),
    "formation_steps": ("reach", "formation_steps"),
    "formation_fill": ("reach", "formation_fill"),
    "reach_heads": ("reach", "heads"),
    "reach_window": ("reach", "window"),
    "settle_margin": ("settle", "margin"),
    "warmup_steps": ("schedule", "warmup_steps"),
    "control_interval": ("schedule", "control_interval"),
    "freeze_after": ("schedule", "freeze_after"),
}
# Format 1's flat settings, which format 2 holds in ``gpt``.
_FLAT_GPT_SETTINGS = (
    "vocab_size",
    "seq_len",
    "n_layer",
    "n_head",
    "n_embd",
    "mlp_ratio",
    "bias",
    "rope_base",
    "backend",
    "block_size",
    "document_mask",
    "compile_blocks",
    "activation_checkpointing",
    "full_heads_beyond_trained",
)


# -- reading a file ----------------------------------------------------------------------------------------------------
def is_remote(path) -> bool:
    """An object-store path or URL (``s3://...``), read and written through fsspec."""
    return "://" in str(path)


# (realpath, size, mtime_ns) of files whose checksums were verified in this process: a file checked by the CLI
# before training is not read twice when Lightning then loads it.
_verified: set[tuple] = set()


def verify_checkpoint_file(path, setting: str = "ckpt_path", suggest: bool = True) -> None:
    """Raise ``ConfigError`` unless ``path`` is a readable, complete PyTorch archive with matching checksums. The
    error for a damaged file names the newest checkpoint beside it that verifies (unless ``suggest`` is False)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        hint = ", or 'last'" if setting == "ckpt_path" else ""
        raise ConfigError(f"{setting}={path!r} does not exist: pass an existing checkpoint file{hint}")
    if os.path.isdir(path):
        raise ConfigError(f"{setting}={path!r} is a folder: pass a checkpoint file (*.ckpt)")
    if not os.access(path, os.R_OK):
        raise ConfigError(f"{setting}={path!r} is not readable (check its permissions)")
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns)
    if key in _verified:
        return
    if not zipfile.is_zipfile(path):
        raise ConfigError(
            f"{setting}={path!r} is truncated or not a PyTorch checkpoint ({st.st_size} bytes, no complete archive): "
            f"{_earlier(path, suggest)}"
        )
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()  # reads every entry and checks its CRC32
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error, RuntimeError) as e:
        raise ConfigError(f"{setting}={path!r} is corrupt ({first_line(e)}): {_earlier(path, suggest)}") from e
    if bad is not None:
        raise ConfigError(
            f"{setting}={path!r} is corrupt: the checksum of its entry {bad!r} does not match (a damaged copy or "
            f"disk): {_earlier(path, suggest)}"
        )
    _verified.add(key)


def checkpoint_step(path, weights_only: Optional[bool] = None) -> Optional[int]:
    """The ``global_step`` of the checkpoint at ``path`` if it verifies (a file: complete, checksums, weights-only;
    an FSDP2 folder: its ``.metadata`` and ``meta.pt``), else None."""
    path = os.fspath(path)
    if os.path.isdir(path):
        meta = os.path.join(path, "meta.pt")
        if not os.path.isfile(os.path.join(path, ".metadata")) or not os.path.isfile(meta):
            return None
        path = meta
    try:
        checkpoint = load_checkpoint_file(path, map_location="cpu", weights_only=weights_only, mmap=True, suggest=False)
        step = checkpoint.get(GLOBAL_STEP_KEY)
    except (ConfigError, AttributeError):  # damaged, unsafe, or not a dict
        return None
    return step if isinstance(step, int) else None


def _earlier(path, suggest: bool) -> str:
    return use_earlier(os.fspath(path)) if suggest else "use an earlier checkpoint"


def use_earlier(path: str) -> str:
    """What to do instead of loading the damaged checkpoint ``path``: the newest checkpoint in its folder (the
    highest step) that verifies, by name."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".ckpt"))
    except OSError:
        names = []
    steps = {}
    for name in names:
        other = os.path.join(folder, name)
        if os.path.abspath(other) != os.path.abspath(path) and (step := checkpoint_step(other)) is not None:
            steps[other] = step
    if not steps:
        return f"use an earlier checkpoint (no other checkpoint in {folder} verifies)"
    best = max(steps, key=lambda p: (steps[p], os.path.basename(p).startswith("last")))
    return f"use an earlier checkpoint: the newest in that folder that verifies is {best} (step {steps[best]})"


def _unsafe_reason(e: BaseException) -> str:
    text = str(e)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1]
    return first_line(Exception(text.strip()), 120)


def load_checkpoint_file(
    path,
    map_location: Any = None,
    weights_only: Optional[bool] = None,
    mmap: bool = False,
    setting: str = "ckpt_path",
    suggest: bool = True,
) -> Any:
    """``torch.load`` of a verified file (``verify_checkpoint_file``). ``weights_only=None`` means True; only an
    explicit False allows arbitrary pickles. Returns what the file holds (a checkpoint: a dict)."""
    safe = weights_only is not False
    if is_remote(path):  # object stores and URLs, through fsspec; still weights-only by default
        from lightning.fabric.utilities.cloud_io import get_filesystem

        with get_filesystem(path).open(path, "rb") as f:
            return torch.load(f, map_location=map_location, weights_only=safe)
    verify_checkpoint_file(path, setting, suggest)
    try:
        return torch.load(os.fspath(path), map_location=map_location, weights_only=safe, mmap=mmap)
    except pickle.UnpicklingError as e:
        if safe and "weights only" in str(e).lower():
            raise ConfigError(
                f"{setting}={os.fspath(path)!r} holds objects other than tensors and plain values "
                f"({_unsafe_reason(e)}); unpickling them could run arbitrary code. If you trust the file, pass "
                f"--weights_only false"
            ) from e
        raise ConfigError(
            f"{setting}={os.fspath(path)!r} is corrupt ({first_line(e)}): {_earlier(path, suggest)}"
        ) from e
    except (RuntimeError, EOFError, OSError, KeyError, ValueError) as e:
        raise ConfigError(
            f"{setting}={os.fspath(path)!r} cannot be read ({type(e).__name__}: {first_line(e)}): it is corrupt or "
            f"not a checkpoint; {_earlier(path, suggest)}"
        ) from e


def read_checkpoint(
    path, *, weights_only: bool = True, mmap: bool = False, map_location: Any = "cpu", setting: str = "checkpoint"
) -> dict:
    """The checkpoint dict in file ``path``, verified (complete archive, matching checksums) and unpickled
    weights-only unless ``weights_only=False``. A missing, truncated, corrupt or unsafe file, or one that holds no
    dict, is one ``ConfigError`` line that names ``setting`` and the file."""
    checkpoint = load_checkpoint_file(
        path, map_location=map_location, weights_only=weights_only, mmap=mmap, setting=setting
    )
    if not isinstance(checkpoint, dict):
        raise ConfigError(
            f"{setting}={os.fspath(path)!r} is not a Lightning checkpoint (it holds a {type(checkpoint).__name__})"
        )
    return checkpoint


# -- what a checkpoint holds -------------------------------------------------------------------------------------------
def plain_key(key: str) -> str:
    """A weight's name without torch.compile's wrapper (compiling a block does not change what its weights are)."""
    return key.replace(COMPILED_PREFIX, "")


def gpt_state(state_dict: Mapping) -> dict[str, torch.Tensor]:
    """The GPT's own state dict (its weights and window table ``windows``) in a LightningModule's ``state_dict``:
    the entries under ``MODEL_PREFIX``, without it and with compiled blocks' names plain."""
    return {plain_key(k)[len(MODEL_PREFIX) :]: v for k, v in state_dict.items() if k.startswith(MODEL_PREFIX)}


def has_text_tokenizer(data: Mapping, tokenizer: str | None = None) -> bool:
    """Whether a checkpoint's model reads text through a tokenizer: the one rule that import, export, generation and
    ``model.init_from`` follow. ``data``: its data settings (``data_settings``); ``tokenizer``: one the user gave,
    which always counts. A model of token ids (``data.source`` synthetic or recall: sources whose ids are no
    tokenizer's) has none; an unknown source counts as text."""
    return tokenizer is not None or is_text(data.get("source", "stdlib"))


def upgrade_hyperparameters(hparams: Mapping) -> dict:
    """The module's hyperparameters ``hparams`` of any layout in today's (``HPARAMS_FORMAT``): format 1's flat GPT
    settings moved into ``gpt``, format 1's and 2's flat policy settings into their policy's
    block, format 1-3's flat controller settings into the controller's blocks. A layout newer than this code knows is a ``ConfigError``."""
    hparams = dict(hparams)
    version = hparams.pop(HPARAMS_FORMAT_ENTRY, 1)
    if version not in (1, 2, 3, HPARAMS_FORMAT):
        raise ConfigError(
            f"the checkpoint's hyperparameters have layout {version!r}, this aah reads up to {HPARAMS_FORMAT}: it was "
            f"written by a newer aah"
        )
    if version == 1:
        gpt = {k: hparams.pop(k) for k in _FLAT_GPT_SETTINGS if k in hparams}
        hparams = {"gpt": gpt, **hparams}
    if version in (1, 2) and isinstance(hparams.get("aah"), Mapping):
        aah = dict(hparams["aah"])
        for key, blocks in FLAT_POLICY_SETTINGS.items():
            value = aah.pop(key, None)
            for block in blocks if value is not None else ():
                aah[block] = {**aah.get(block, {}), key: value}
        hparams["aah"] = aah
    if version in (1, 2, 3) and isinstance((hparams.get("aah") or {}).get("controller"), Mapping):
        controller = dict(hparams["aah"]["controller"])
        for key, (block, name) in FLAT_CONTROLLER_SETTINGS.items():
            if key in controller and not isinstance(controller[key], Mapping):  # a flat value, not a block
                controller[block] = {**controller.get(block, {}), name: controller.pop(key)}
        hparams["aah"] = {**hparams["aah"], "controller": controller}
    hparams[HPARAMS_FORMAT_ENTRY] = HPARAMS_FORMAT
    return hparams


def hyperparameters(checkpoint: Mapping) -> dict:
    """The module's hyperparameters (the ``model.*`` settings: ``gpt``, ``aah``, ``optim``) in today's layout, whatever
    layout the checkpoint holds, without the private ``_`` entries (the layout's version, Lightning's
    ``_instantiator``): ``AAHModule(**hyperparameters(checkpoint))`` is the checkpoint's module."""
    hparams = upgrade_hyperparameters(checkpoint.get(HYPER_PARAMETERS_KEY) or {})
    return {k: v for k, v in hparams.items() if not k.startswith("_")}


def gpt_settings(checkpoint: Mapping) -> dict:
    """The GPT's settings (``model.gpt.*``) of a checkpoint of any layout; empty when it has none."""
    return dict(hyperparameters(checkpoint).get("gpt") or {})


def sink_setting(checkpoint: Mapping) -> int:
    """The model's attention sink, ``model.aah.sink`` of the checkpoint's hyperparameters (0 for checkpoints written
    before the setting existed): the one place a GPT built from a checkpoint learns its sink."""
    return int((hyperparameters(checkpoint).get("aah") or {}).get("sink", 0))


def data_settings(checkpoint: Mapping) -> dict:
    """The data module's hyperparameters (the ``data.*`` settings) in today's layout, each source's settings in its
    block (``data/config.py``), whatever layout the checkpoint holds, without the private ``_`` entries (Lightning's
    ``_instantiator``): ``TextDataModule(**data_settings(ckpt))`` is the run's data module; empty when it has none."""
    saved = checkpoint.get(DATAMODULE_HYPER_PARAMETERS_KEY) or {}
    return nest_data_settings({k: v for k, v in saved.items() if not k.startswith("_")})


def window_table(checkpoint: Mapping) -> torch.Tensor:
    """The window table ``[n_layer, n_head]`` of a checkpoint: its state_dict's ``model.windows`` (compiled or not).
    Also takes a bare state_dict: a LightningModule's, or a GPT's own (``windows``)."""
    state = checkpoint.get(STATE_DICT_KEY, checkpoint)
    found = [k for k, v in state.items() if torch.is_tensor(v) and plain_key(k) == WINDOWS_STATE_KEY]
    if not found and torch.is_tensor(state.get("windows")):
        found = ["windows"]
    if not found:
        found = [k for k, v in state.items() if k.endswith(".windows") and torch.is_tensor(v) and v.dim() == 2]
    if len(found) != 1:
        raise ConfigError(f"no unique window table in the checkpoint (keys ending in .windows: {found})")
    return state[found[0]]


def check_matches(checkpoint: Mapping, module, path: str = "checkpoint") -> None:
    """The checkpoint holds weights of exactly ``module``'s shapes and its attention sink; otherwise one line saying which
    setting differs."""
    theirs = gpt_settings(checkpoint)
    ours = asdict(module.gpt_config)
    diffs = [k for k in WEIGHT_SHAPE_SETTINGS if k in theirs and theirs[k] != ours[k]]
    if diffs:
        got = ", ".join(f"model.gpt.{k}={theirs[k]!r}" for k in diffs)
        want = ", ".join(f"model.gpt.{k}={ours[k]!r}" for k in diffs)
        hint = " (the vocabulary follows data.tokenizer / data.source)" if "vocab_size" in diffs else ""
        raise ConfigError(
            f"ckpt_path={path!r} holds a model with {got}, but this run builds {want}{hint}: use the settings the "
            f"checkpoint was trained with"
        )
    ours_sink = getattr(getattr(module, "aah_config", None), "sink", 0)
    if HYPER_PARAMETERS_KEY in checkpoint and sink_setting(checkpoint) != ours_sink:
        raise ConfigError(
            f"ckpt_path={path!r} holds a model trained with model.aah.sink={sink_setting(checkpoint)}, but this run "
            f"has model.aah.sink={ours_sink}: use the sink the checkpoint was trained with"
        )
    state = checkpoint.get(STATE_DICT_KEY)
    if state is None:  # e.g. a distributed checkpoint whose weights the strategy loads itself
        return
    expected = {plain_key(k): tuple(v.shape) for k, v in module.state_dict().items()}
    found = {plain_key(k): tuple(v.shape) for k, v in state.items() if hasattr(v, "shape")}
    wrong = [
        f"{k} {found[k]} vs {expected[k]}" for k in sorted(expected.keys() & found.keys()) if found[k] != expected[k]
    ]
    problems = wrong
    if getattr(module, "strict_loading", True):
        problems = problems + [f"missing {k}" for k in sorted(expected.keys() - found.keys())]
        problems = problems + [f"unexpected {k}" for k in sorted(found.keys() - expected.keys())]
    if problems:
        more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ConfigError(
            f"ckpt_path={path!r} does not fit this model ({'; '.join(problems[:3])}{more}): it was saved by a "
            f"different model or code version"
        )


# -- the model of a checkpoint -----------------------------------------------------------------------------------------
def build_model(checkpoint: Mapping, path="checkpoint", setting: str = "checkpoint") -> GPT:
    """The GPT of a checkpoint dict: built from its hyperparameters, then given its weights and window table (eval
    mode, on the CPU). Anything that does not fit is one ``ConfigError`` line naming ``setting`` and ``path``."""
    where = f"{setting}={os.fspath(path)!r}"
    if HYPER_PARAMETERS_KEY not in checkpoint or STATE_DICT_KEY not in checkpoint:
        raise ConfigError(
            f"{where} is not a checkpoint written by aah fit (no {HYPER_PARAMETERS_KEY}/{STATE_DICT_KEY})"
        )
    try:
        model = GPT(GPTConfig(**gpt_settings(checkpoint)), sink=sink_setting(checkpoint))
    except (ConfigError, TypeError, ValueError) as e:
        raise ConfigError(f"{where} does not describe an aah GPT ({e})") from e
    try:
        model.load_state_dict(gpt_state(checkpoint[STATE_DICT_KEY]))
    except RuntimeError as e:  # missing, unexpected, or tensors of another shape than the hyperparameters say
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        raise ConfigError(f"{where}: its weights do not match its hyperparameters ({lines[-1][:200]})") from e
    return model.eval()


def checkpoint_tokenizer(checkpoint: Mapping, tokenizer: str | None = None, setting: str = "data.tokenizer"):
    """The tokenizer a checkpoint's model was trained with (``tokenizer`` overrides the data settings' one); None for
    a model of token ids (``data.source`` synthetic or recall) unless ``tokenizer`` is given. A tokenizer with more ids
    than the model's vocabulary is a ``ConfigError`` (naming ``setting`` when ``tokenizer`` was given)."""
    data = data_settings(checkpoint)
    if not has_text_tokenizer(data, tokenizer):
        return None
    spec = tokenizer or data.get("tokenizer", "byte")
    tok = load_tokenizer(spec, setting if tokenizer else "data.tokenizer")
    vocab = gpt_settings(checkpoint).get("vocab_size")
    if vocab is not None and tok.vocab_size > vocab:
        raise ConfigError(
            f"tokenizer {spec!r} has {tok.vocab_size} ids, the checkpoint's model {vocab}: use the tokenizer the "
            f"model was trained with"
        )
    return tok


def load_model(
    path,
    device: str | torch.device = "cpu",
    *,
    tokenizer: str | None = None,
    weights_only: bool = True,
    setting: str = "checkpoint",
    tokenizer_setting: str = "tokenizer",
):
    """``(model, tokenizer)`` of checkpoint file ``path``: the GPT with its weights and window table, in eval mode on
    ``device``, and the tokenizer of its data settings (``tokenizer`` overrides; None for a model trained on token ids,
    the synthetic and recall tasks). The file is verified and read weights-only (``read_checkpoint``); every problem
    is one ``ConfigError`` line (``tokenizer_setting`` names the ``tokenizer`` override in it)."""
    checkpoint = read_checkpoint(path, weights_only=weights_only, setting=setting)
    model = build_model(checkpoint, path, setting)
    tok = checkpoint_tokenizer(checkpoint, tokenizer, tokenizer_setting)
    return model.to(device), tok
