"""The optional packages: which pip extra installs each, and one clear line when one is missing.

A plain ``pip install -e .`` runs ``aah fit / validate / test / predict`` and ``aah-prepare`` on the byte tokenizer;
the packages below are needed only for the features named beside them. Code imports them through ``need``, inside
the function that uses them, never at module level, so that a missing extra is one line naming it instead of a
traceback. tests/test_dependencies.py checks every import of the package against pyproject.toml with this table.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from aah_lightning.errors import ConfigError

# import name -> (distribution on PyPI, the extra of pyproject.toml that installs it)
EXTRAS: dict[str, tuple[str, str]] = {
    "tokenizers": ("tokenizers", "hf"),  # data.tokenizer: a tokenizer.json or hub name; aah export's tokenizer
    "transformers": ("transformers", "hf"),  # aah export
    "safetensors": ("safetensors", "hf"),  # aah import, aah export
    "gguf": ("gguf", "gguf"),  # aah import of a GGUF file (transformers' GGUF reader)
    "accelerate": ("accelerate", "gguf"),  # transformers (5.x) loads a GGUF model only with it
    "flash_attn": ("flash-attn-4", "fa4"),  # model.gpt.backend=flex_fa4 (CUDA)
    "wandb": ("wandb", "wandb"),  # trainer.logger: WandbLogger
}

# Subpackages that only ever run with an extra installed, so their imports may be module-level: the exported model's
# remote code runs inside transformers, and the lm-eval task inside lm-evaluation-harness.
EXTRA_ONLY_PACKAGES: dict[str, str] = {
    "aah_lightning.export.hf_code": "hf",
    "aah_lightning.export.lm_eval_tasks": "eval",
}


def install_hint(extra: str) -> str:
    return f"pip install 'aah-lightning[{extra}]'"


def need(module: str, purpose: str, extra: str | None = None) -> ModuleType:
    """Import ``module`` (a name or dotted name of a package in ``EXTRAS``) for ``purpose`` ("aah export", ...), or
    raise ConfigError naming the extra that installs it: its own, or ``extra``, a feature's extra that brings it too
    (the 'gguf' extra brings the 'hf' extra's transformers), so that one install gives the whole feature."""
    distribution, own = EXTRAS[module.split(".")[0]]
    extra = extra or own
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ConfigError(
            f"{purpose} needs the '{extra}' extra ({distribution} is missing): {install_hint(extra)}"
        ) from e
