"""The ``aah`` command: a LightningCLI over AAHModule and TextDataModule.

``aah fit|validate|test --config X.yaml`` (``--print_config``, ``--ckpt_path last``); ``aah predict --config X.yaml
--ckpt_path C --data.prompts P --generate.output O`` writes completions (docs/generation.md); ``aah export
--ckpt_path C --out DIR`` writes a Hugging Face transformers folder (docs/export.md); ``aah import FOLDER --out C``
writes a Hugging Face Llama-family folder as an aah checkpoint (docs/retrofit.md). Settings the user gives
once are linked: ``data.seq_len`` sets the model's T, the tokenizer sets the model's vocabulary. Bad settings end the
run with one line naming the setting, before any compute is spent (docs/robustness.md lists every check). Every run
saves checkpoints atomically (``AtomicCheckpointIO``) and stops at the first non-finite loss (``NonFiniteGuard``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import shlex
import signal
import sys
import traceback
import typing
from typing import Optional

import torch
from jsonargparse import ActionConfigFile, Namespace
from lightning.fabric.plugins.environments import ClusterEnvironment, SLURMEnvironment
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from aah_lightning import preflight
from aah_lightning.checkpoint import LOG_FOLDER_KEY
from aah_lightning.data.prompts import read_prompts, require_text_tokenizer
from aah_lightning.errors import CheckpointWriteError, ConfigError, TrainingDiverged
from aah_lightning.inputs import first_line, read_yaml
from aah_lightning.lit.atomic_files import AtomicCheckpointIO
from aah_lightning.lit.datamodule import TextDataModule
from aah_lightning.lit.diagnostics import WindowDiagnostics
from aah_lightning.lit.distributed import shutdown_process_group
from aah_lightning.lit.folder_lock import release_folder_locks
from aah_lightning.lit.generation import GenerationWriter, ValidationSample, check_writable
from aah_lightning.lit.guards import NonFiniteGuard
from aah_lightning.lit.last_checkpoint import BestCheckpoint, LastCheckpoint
from aah_lightning.lit.module import AAHModule
from aah_lightning.lit.signals import INTERRUPT_EXIT_CODE, SIGTERM_EXIT_CODE, SignalStop
from aah_lightning.lit.throughput import ProgressBar, Throughput
from aah_lightning.model.config import GPTConfig


def _vocab_of(datamodule) -> int:
    return datamodule.vocab_size


_LITERAL_ERROR = re.compile(r"Expected a typing\.Literal\[(.*?)\]\. Got value: (.*)")


def choice_error(message: str) -> Optional[str]:
    """jsonargparse's report of a value outside a ``Literal`` setting (nested keys, union subtypes, several lines) as
    one line naming the setting and its choices; None for any other parse error."""
    found = _LITERAL_ERROR.search(message)
    if found is None:
        return None
    setting = ".".join(re.findall(r'Parser key "([^"]+)"', message[: found.start()]))
    choices = [c.strip().strip("'\"") for c in found.group(1).split(",")]
    allowed = ", ".join(choices[:-1]) + " or " + choices[-1] if len(choices) > 1 else choices[0]
    return f"{setting}={found.group(2).strip()!r} is not allowed: one of {allowed}"


_UNKNOWN_MODEL_SETTING = re.compile(r"(?:unrecognized arguments:.*?--|does not accept option ')model\.(\w+)\b")


def moved_setting(message: str) -> Optional[str]:
    """jsonargparse's report of an unknown ``model.<name>`` that is one of the GPT's settings (a command line or
    config of the time before ``model.gpt``) as one line saying where it is now; None for any other parse error."""
    found = _UNKNOWN_MODEL_SETTING.search(message)
    if found is None or found.group(1) not in {f.name for f in dataclasses.fields(GPTConfig)}:
        return None
    name = found.group(1)
    return f"model.{name} is now model.gpt.{name}: the GPT's settings are under model.gpt (aah fit --help)"


def setting_names(parser) -> list[str]:
    """Every setting a (subcommand) parser takes, dotted; the fields of dataclass settings (``model.aah``,
    ``model.optim``: one argument each for jsonargparse) included."""
    names = []

    def add(prefix: str, hint) -> None:
        for arg in typing.get_args(hint) or (hint,):  # Optional[X] / Union: every member
            if dataclasses.is_dataclass(arg):
                try:
                    hints = typing.get_type_hints(arg)  # the fields' types, also where they are strings
                except Exception:
                    hints = {}
                for f in dataclasses.fields(arg):
                    if f.name in getattr(arg, "DEPRECATED_FIELDS", ()):  # never suggest a deprecated key
                        continue
                    names.append(f"{prefix}.{f.name}")
                    add(f"{prefix}.{f.name}", hints.get(f.name))

    for action in parser._actions:
        dest = action.dest
        if dest in ("help", "config") or dest.endswith((".help", ".config")) or dest == argparse.SUPPRESS:
            continue
        names.append(dest)
        add(dest, getattr(action, "_typehint", None))
    return list(dict.fromkeys(names))


def _flat_keys(config, prefix: str = "") -> set[str]:
    keys = set()
    if isinstance(config, dict):
        for key, value in config.items():
            name = f"{prefix}{key}"
            keys.add(name)
            keys |= _flat_keys(value, f"{name}.")
    return keys


def setting_source(key: str, argv) -> str:
    """The --config file that sets ``key`` last on the command line ``argv``, as 'in FILE'; '' if none does or the
    command line itself sets it later (a later source overrides an earlier one)."""
    where, args = "", [str(a) for a in argv] if isinstance(argv, (list, tuple)) else []
    for i, arg in enumerate(args):
        if arg in ("-c", "--config") and i + 1 < len(args) or arg.startswith("--config="):
            path = arg.split("=", 1)[1] if "=" in arg else args[i + 1]
            if os.path.isfile(path):
                try:
                    config = read_yaml(path, "--config")
                except ConfigError:
                    continue
                if key in _flat_keys(config):
                    where = f"in {path}"
        elif arg.startswith("--") and arg[2:].split("=", 1)[0] == key:
            where = ""
    return where


_UNKNOWN_SETTING = re.compile(r"unrecognized arguments: (\S+)|does not accept option '([^']+)'")
_UNKNOWN_FIELD = re.compile(r"Option '([^']+)' is not accepted")  # a field a dataclass setting lacks
_EXPECTED = re.compile(r"Expected a <class '(?:[\w.]+\.)?(\w+)'>")
_GIVEN = re.compile(r"(?:Got|Given) value: (.*)")


def _subcommand_parser(parser, argv):
    """The parser of the subcommand being run (errors in config files are reported by the root parser)."""
    name = str(argv[0]) if isinstance(argv, (list, tuple)) and argv else ""
    subcommands = getattr(parser, "_subcommands_action", None)
    if subcommands is not None and name in subcommands._name_parser_map:
        return name, subcommands._name_parser_map[name]
    return (parser.prog.split()[-1] if parser.prog else ""), parser


def parse_error(message: str, parser, argv) -> str:
    """jsonargparse's report of a command line or config it cannot parse (an unknown setting, a value of the wrong
    type, a value outside a setting's choices, anything else) as one line naming the setting, where it was set and,
    for an unknown one, the nearest valid setting; without the usage (``--help`` prints that)."""
    subcommand, parser = _subcommand_parser(parser, argv)
    listed = f"aah {subcommand} --help lists every setting"
    line = moved_setting(message)
    if line is not None:
        return line
    keys = re.findall(r'Parser key "([^"]+)"', message)
    unknown, field = _UNKNOWN_SETTING.search(message), _UNKNOWN_FIELD.search(message)
    if unknown is not None or field is not None:
        if unknown is not None:
            key = (unknown.group(1) or unknown.group(2)).lstrip("-").split("=", 1)[0]
        else:
            key = ".".join([*keys[: 1 if keys else 0], field.group(1)])
        given = [
            str(a)[2:].split("=", 1)[0]
            for a in (argv if isinstance(argv, (list, tuple)) else ())
            if str(a).startswith("--")
        ]
        key = next((g for g in given if g.endswith(f".{key}")), key)  # jsonargparse cuts nested dataclass keys
        where = setting_source(key, argv)
        near = difflib.get_close_matches(key, setting_names(parser), n=1, cutoff=0.6)
        hint = f"did you mean {near[0]}? ({listed})" if near else listed
        return f"{key}{f' (set {where})' if where else ''} is not a setting of aah {subcommand}: {hint}"
    key = ".".join(keys)
    where = f" (set {w})" if keys and (w := setting_source(key, argv)) else ""
    line = choice_error(message)
    if line is not None:
        return line.replace(" is not allowed:", f"{where} is not allowed:", 1)
    given = _GIVEN.search(message)
    if keys and given is not None and _EXPECTED.search(message):
        types = list(
            dict.fromkeys(t if t != "NoneType" else "null" for t in _EXPECTED.findall(message[: given.start()]))
        )
        return f"{key}={given.group(1).strip()!r}{where} is not allowed: a value of type {' or '.join(types)}"
    return f"{' '.join(message.split())} ({listed})"


class _ArgumentParser(LightningArgumentParser):
    """Lightning's parser; every parse error is one line (``parse_error``), like every other bad setting."""

    argv = None  # the command line being parsed (set by AAHCLI.parse_arguments): where a bad setting came from

    def error(self, message: str, ex: Optional[Exception] = None):
        if not self.exit_on_error:
            return super().error(message, ex)
        print(f"aah: error: {parse_error(message, self, _ArgumentParser.argv)}", file=sys.stderr)
        sys.exit(2)


class AAHCLI(LightningCLI):
    def init_parser(self, **kwargs) -> LightningArgumentParser:
        parser = _ArgumentParser(**kwargs)
        parser.add_argument("-c", "--config", action=ActionConfigFile, help="Path to a configuration file (yaml).")
        return parser

    def parse_arguments(self, parser, args) -> None:
        _ArgumentParser.argv = sys.argv[1:] if args is None else args
        super().parse_arguments(parser, args)

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.seq_len", "model.gpt.seq_len")
        parser.link_arguments("data", "model.gpt.vocab_size", compute_fn=_vocab_of, apply_on="instantiate")
        # Two checkpoints in one folder: last.ckpt every N steps (what --ckpt_path last resumes) and the best model by
        # validation loss. Both are written through AtomicCheckpointIO (see instantiate_trainer).
        parser.add_lightning_class_args(LastCheckpoint, "checkpoint")
        parser.set_defaults({"checkpoint.dirpath": "runs/aah/checkpoints"})
        parser.add_lightning_class_args(BestCheckpoint, "best_checkpoint")
        parser.link_arguments("checkpoint.dirpath", "best_checkpoint.dirpath")
        parser.set_defaults(
            {
                "best_checkpoint.filename": "best-step{step}",
                "best_checkpoint.auto_insert_metric_name": False,
                "best_checkpoint.monitor": "val/loss",
                "best_checkpoint.mode": "min",
                "best_checkpoint.save_top_k": 1,
                "best_checkpoint.save_last": False,
                "best_checkpoint.enable_version_counter": False,  # the same step's best is the same file
            }
        )
        parser.add_lightning_class_args(Throughput, "throughput")
        parser.add_lightning_class_args(WindowDiagnostics, "diagnostics")
        parser.add_lightning_class_args(NonFiniteGuard, "nonfinite_guard")
        parser.add_lightning_class_args(ValidationSample, "sample")
        parser.add_lightning_class_args(GenerationWriter, "generate")
        parser.set_defaults(
            {
                "trainer.logger": {
                    "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                    "init_args": {"save_dir": "runs", "name": "aah"},
                },
                "trainer.max_steps": 1000,
                "trainer.log_every_n_steps": 10,
                "trainer.gradient_clip_val": 1.0,
                "trainer.use_distributed_sampler": False,  # the data module shards by rank itself
            }
        )

    def before_instantiate_classes(self) -> None:
        # bf16-mixed on a GPU, fp32 on CPU, unless the config says otherwise.
        cfg = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        trainer = cfg["trainer"]
        preflight.check_devices(trainer.get("accelerator"), trainer.get("devices"))  # before any class is built
        if trainer.get("precision") is None:
            on_gpu = torch.cuda.is_available() and trainer.get("accelerator") in ("auto", "gpu", "cuda", None)
            trainer["precision"] = "bf16-mixed" if on_gpu else "32-true"

    def _parse_ckpt_path(self) -> None:
        """Deliberately off. Lightning would read the model's hyperparameters from a ``--ckpt_path`` file here, at
        parse time, with a bare ``torch.load`` (a traceback for a corrupt file, ``--weights_only false`` ignored), and
        let them silently override the config, even settings given on the command line. Here the config you pass is
        the config you get; ``_preflight`` verifies the file and reports a checkpoint of another shape in one line."""

    def instantiate_trainer(self, **kwargs):
        # Crash-safe checkpoint files for every run, unless the config brings its own CheckpointIO plugin.
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        plugins = config["trainer"].get("plugins")
        plugins = [] if plugins is None else list(plugins) if isinstance(plugins, (list, tuple)) else [plugins]
        if not any(isinstance(p, CheckpointIO) for p in plugins):
            plugins.append(AtomicCheckpointIO())
        # Under SLURM the batch script requeues the job (configs/cluster/slurm.sbatch). Lightning's own handler would
        # requeue it too when USR1 reaches the tasks, after saving a mid-step hpc_ckpt that a restart without
        # --ckpt_path would resume from. LastCheckpoint takes a USR1 that reaches the tasks instead (save the step,
        # then one requeue).
        if SLURMEnvironment.detect() and not any(isinstance(p, ClusterEnvironment) for p in plugins):
            plugins.append(SLURMEnvironment(auto_requeue=False))
        try:
            trainer = super().instantiate_trainer(plugins=plugins, **kwargs)
        except (MisconfigurationException, ValueError, TypeError, ImportError) as e:
            # What check_devices cannot foresee (strategies, num_nodes, device combinations): Lightning's first line.
            if not any(f.filename.endswith("accelerator_connector.py") for f in traceback.extract_tb(e.__traceback__)):
                raise
            t = config["trainer"]
            given = ", ".join(f"trainer.{k}={t.get(k)!r}" for k in ("accelerator", "devices", "strategy", "num_nodes"))
            raise ConfigError(f"{given} cannot be used on this machine: {first_line(e)}") from e
        default_bar = vars(RichProgressBar())
        for i, callback in enumerate(trainer.callbacks):  # Lightning's default bar (not one the config configured)
            if type(callback) is RichProgressBar and vars(callback) == default_bar:
                trainer.callbacks[i] = ProgressBar()
        return trainer

    def _preflight(self, subcommand: str) -> None:
        # Runs after every class is built and before the Trainer starts: device, tokenizer and checkpoint checks.
        cfg = self.config_init[subcommand]
        path, resumed = preflight.preflight(
            self.trainer, self.model, self.datamodule, subcommand, cfg.get("ckpt_path"), cfg.get("weights_only")
        )
        if "ckpt_path" in cfg:
            cfg["ckpt_path"] = path  # 'last' resolved to the file just checked, so Lightning loads that one
        if subcommand == "fit" and resumed is not None:
            self._continue_log_folder(resumed)

    def _continue_log_folder(self, resumed: preflight.Resumed) -> None:
        """A resumed run logs on in the folder of the run it continues (one TensorBoard version, one config.yaml),
        unless the config gives the logger a version or points it elsewhere."""
        logger, spec = self.trainer.logger, self.config[self.subcommand]["trainer"].get("logger")
        init_args = spec.get("init_args") if isinstance(spec, Namespace) else None
        if (
            logger is None
            or len(self.trainer.loggers) != 1
            or init_args is None
            or init_args.get("version") is not None
        ):
            return
        saved = resumed.entry(LOG_FOLDER_KEY)
        if saved and (saved["save_dir"], saved["name"]) == (logger.save_dir, logger.name):
            self.trainer.logger = type(logger)(**{**init_args.as_dict(), "version": saved["version"]})

    def before_fit(self) -> None:
        self._preflight("fit")

    def before_validate(self) -> None:
        self._preflight("validate")

    def before_test(self) -> None:
        self._preflight("test")

    def before_predict(self) -> None:
        # Every check of aah predict before the Trainer starts: once it runs, the logger has written its folder.
        read_prompts(self.datamodule.config.prompts)  # a missing or empty prompts file, before the checkpoint is read
        for callback in self.trainer.callbacks:
            if isinstance(callback, GenerationWriter):
                check_writable(callback.output)
        self._preflight("predict")
        require_text_tokenizer(self.datamodule.tokenizer)


def _user_error(exc: BaseException | None):
    """The ConfigError / TrainingDiverged / CheckpointWriteError behind ``exc``, if any. jsonargparse wraps errors
    raised while it instantiates a class given as a union type (``trainer.callbacks``, ``trainer.plugins``, optional
    dataclasses) in a ValueError listing every subtype; the original is on the cause / context chain."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, (ConfigError, TrainingDiverged, CheckpointWriteError)):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def check_config_files(argv) -> None:
    """Every ``--config`` / ``-c`` file of the command line is a readable UTF-8 YAML mapping: one line naming it
    otherwise (jsonargparse prints its whole usage for a missing file and a traceback for one that is not UTF-8).
    A YAML string given in place of a file is left to jsonargparse."""
    if not isinstance(argv, (list, tuple)):
        return
    for i, arg in enumerate(argv):
        arg = str(arg)
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        elif arg in ("-c", "--config") and i + 1 < len(argv):
            path = str(argv[i + 1])
        else:
            continue
        if not os.path.exists(path) and ("\n" in path or path.lstrip().startswith("{") or ": " in path):
            continue  # jsonargparse also takes the settings themselves, as a YAML string
        config = read_yaml(path, "--config")
        if config is not None and not isinstance(config, dict):
            raise ConfigError(f"--config={path!r} holds a YAML {type(config).__name__}, not a mapping of settings")


def sigterm_report(stop: SIGTERMException, argv) -> str:
    """What happened and how to go on, after SIGTERM, SIGINT (or SLURM's requeue signal) ended a run."""
    if not isinstance(stop, SignalStop):  # Lightning's: the signal came before the first training step
        return (
            "stopped by SIGTERM before this run finished a training step: nothing was saved (an earlier last.ckpt is "
            "unchanged)"
        )
    command = "aah fit ... --ckpt_path last"
    if isinstance(argv, (list, tuple)) and argv and argv[0] == "fit":
        kept, skip = [], False
        for arg in map(str, argv[1:]):
            if skip or arg.startswith("--ckpt_path="):
                skip = False
                continue
            if arg == "--ckpt_path":
                skip = True
                continue
            kept.append(arg)
        command = shlex.join(["aah", "fit", *kept, "--ckpt_path", "last"])
    name = signal.Signals(stop.signum).name
    if stop.requeue is not None:
        return (
            f"stopped by {name} (SLURM's requeue signal) after step {stop.step}: its checkpoint is {stop.path}; "
            f"{stop.requeue}"
        )
    return f"stopped by {name} after step {stop.step}: its checkpoint is {stop.path}; resume with: {command}"


def main(args=None) -> None:
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, (list, tuple)) and argv and argv[0] == "export":  # not a Trainer run: its own small parser
        from aah_lightning.export.exporter import main as export_main

        sys.exit(export_main(list(argv[1:])))
    if isinstance(argv, (list, tuple)) and argv and argv[0] == "import":  # a Hugging Face folder -> an aah checkpoint
        from aah_lightning.export.importer import main as import_main

        sys.exit(import_main(list(argv[1:])))
    try:
        check_config_files(argv)
        AAHCLI(
            AAHModule,
            TextDataModule,
            save_config_kwargs={"overwrite": True},
            seed_everything_default=1234,
            auto_configure_optimizers=False,
            args=args,
        )
    except Exception as e:
        error = _user_error(e)
        if isinstance(error, ConfigError):  # bad input: nothing was trained
            print(f"aah: error: {error}", file=sys.stderr)
            sys.exit(2)
        if isinstance(error, TrainingDiverged):
            print(f"aah: stopped: {error}", file=sys.stderr)
            sys.exit(3)
        if isinstance(error, CheckpointWriteError):  # every rank of a sharded save stops: rank 0 says why
            if rank_zero_only.rank == 0:
                print(f"aah: error: {error}", file=sys.stderr)
            sys.exit(4)
        raise
    except SIGTERMException as e:  # a SystemExit: Lightning's own carries no code (exit 0); this run's is 143
        if rank_zero_only.rank == 0:
            print(f"aah: {sigterm_report(e, argv)}", file=sys.stderr, flush=True)
        sys.exit(e.code if isinstance(e, SignalStop) else SIGTERM_EXIT_CODE)
    except KeyboardInterrupt:  # Ctrl-C before the Trainer ran (parsing, building the classes): nothing to save
        print("aah: interrupted (SIGINT) before training started: nothing was saved", file=sys.stderr)
        sys.exit(INTERRUPT_EXIT_CODE)
    finally:
        release_folder_locks()
        shutdown_process_group()


if __name__ == "__main__":
    main()
