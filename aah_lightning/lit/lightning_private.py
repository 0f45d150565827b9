"""Every use of Lightning's private API in the package, one function each, where no public way exists.

pyproject pins the Lightning range these were tested with; ``tests/lit/test_lightning_contract.py`` checks each one
against the installed Lightning, so an upgrade that moves one fails there, by name, not somewhere in a run.

Elsewhere, and not wrappable here:

- ``cli.AAHCLI._parse_ckpt_path`` overrides a LightningCLI method to switch it off (the checkpoint's hyperparameters
  never override the config; the contract test ``test_a_resume_keeps_the_given_config_not_the_checkpoints``);
- ``lit/data_position.DataPosition.restate_batch_count`` writes the epoch loop's ``batch_progress`` counters (public
  attributes of an internal object, restored by Lightning on a resume; the contract tests in
  ``tests/lit/test_data_position.py``).
"""

from __future__ import annotations


def inside_accumulation_window(trainer) -> bool:
    """Whether the batch just run is not the last of its gradient-accumulation window (no optimizer step follows),
    as the fit loop itself decides it: no public property says so."""
    return trainer.fit_loop._should_accumulate()


def send_step_metrics(trainer) -> None:
    """Send the logged metrics of the current step to the loggers now, as Lightning does after ``on_train_batch_end``
    (same step, same ``log_every_n_steps``): a run that stops inside that hook would otherwise lose them."""
    trainer._logger_connector.on_batch_end()
    trainer._logger_connector.update_train_step_metrics()


def cluster_environment(trainer):
    """The cluster environment the Trainer chose (SLURM, torchrun, Lightning's own, ...), also before the run starts
    (``trainer.strategy.cluster_environment`` is only set for distributed strategies); None when the trainer has none
    yet."""
    return getattr(getattr(trainer, "_accelerator_connector", None), "cluster_environment", None)


def rank_from_environment() -> int | None:
    """The process's global rank as Lightning reads it from the launcher's environment (``RANK``, ``SLURM_PROCID``,
    ...), for a process that imported Lightning before those variables were set (the test suite's process server)."""
    from lightning.fabric.utilities.rank_zero import _get_rank

    return _get_rank()


# -- ModelCheckpoint: LastCheckpoint saves "last" on its own triggers (the final step, a signal) ------------------------
def should_skip_saving(callback, trainer) -> bool:
    """Whether ``callback`` (a ``ModelCheckpoint``) would not save now: outside fit, in the sanity check, under
    ``fast_dev_run``, or when it already saved this global step."""
    return callback._should_skip_saving_checkpoint(trainer)


def save_last_checkpoint(callback, trainer) -> None:
    """Save ``callback``'s ``last`` checkpoint of the current step now, as ``ModelCheckpoint`` does on its own
    triggers: through ``trainer.save_checkpoint`` (so the checkpoint plugin or the strategy writes it), named from the
    current metrics, step and epoch, with ``last_model_path`` set and the step recorded as saved."""
    callback._save_last_checkpoint(trainer, callback._monitor_candidates(trainer))


def last_step_saved(callback) -> int:
    """The global step of the last checkpoint ``callback`` (a ``ModelCheckpoint``) saved; 0 before its first."""
    return callback._last_global_step_saved


def attached_trainer(module):
    """The Trainer ``module`` (a ``LightningModule``) is attached to, or None: ``module.trainer`` raises when there is
    none (a module loaded or saved by code outside a Trainer)."""
    return module._trainer
