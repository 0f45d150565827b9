"""FSDP2 checkpoints that are swapped in whole: ``AtomicModelParallelStrategy`` (``configs/cluster/fsdp2.yaml``).

Under FSDP2 a checkpoint is a folder that every rank writes itself, outside the checkpoint plugin. This strategy has
every rank write into a hidden temporary folder, then rank 0 makes it the destination in one atomic step
(``swap_in``: a symbolic link swapped with ``os.replace``), as ``atomic.py`` does for single files. A failed write
on any rank (a full disk) stops every rank with the one line of ``atomic.write_error`` (exit code 4), the temporary
folder removed and the previous checkpoint in place.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Any, Optional

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.checkpoint.api import CheckpointException

from aah_lightning.atomic import fsync_dir, partial_name, remove_stale_partials, tensor_bytes, write_error
from aah_lightning.checkpoint import is_remote
from aah_lightning.errors import CheckpointWriteError


def swap_in(tmp: str, final: str) -> None:
    """Make ``final`` the complete checkpoint ``tmp`` (a file or a folder) in one atomic step.

    A file is renamed over ``final``. A folder cannot be renamed over another, so it is kept under a hidden name and
    ``final`` becomes a symbolic link to it, swapped with ``os.replace``; the folder it pointed at before, and any
    left by a writer killed between the swap and the clean-up, are removed afterwards."""
    parent, name = os.path.dirname(os.path.abspath(final)), os.path.basename(final)
    if os.path.isdir(final) and not os.path.islink(final):  # a folder an earlier version saved in place
        os.rename(final, os.path.join(parent, f".{name}.{uuid.uuid4().hex[:8]}"))
    if os.path.isdir(tmp):
        kept = f".{name}.{uuid.uuid4().hex[:8]}"
        os.rename(tmp, os.path.join(parent, kept))
        link = os.path.join(parent, partial_name())
        os.symlink(kept, link)
        os.replace(link, final)
    else:
        os.replace(tmp, final)
    fsync_dir(parent)
    current = os.path.basename(os.path.realpath(final))
    for other in os.listdir(parent):  # earlier folders of this checkpoint name, now unreferenced
        if other.startswith(f".{name}.") and other != current:
            shutil.rmtree(os.path.join(parent, other), ignore_errors=True)


def failed_save(failure: Optional[BaseException], final: str, folder: str, needed: int) -> BaseException:
    """What a rank raises when some rank could not write its part of checkpoint ``final``: the one-line
    ``CheckpointWriteError`` of the first failed write (torch.distributed.checkpoint gives every rank every rank's
    error), or, for anything that is not a failed write, the error itself."""
    if failure is None:  # another rank's own write failed (rank 0's meta.pt): rank 0 says what
        return CheckpointWriteError(f"could not write checkpoint {final}: another process could not write its part")
    errors = [failure]
    if isinstance(failure, CheckpointException):
        errors = [error for _, (error, _trace) in sorted(failure.failures.items())] or errors
    reported = write_error(errors[0], final, folder, needed)
    if reported is None:
        return failure
    reported.__cause__ = errors[0]
    return reported


class AtomicModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2) whose checkpoints are swapped in whole, as single files are.

    With ``save_distributed_checkpoint`` (the default) a checkpoint is a folder - one shard file per rank, the
    ``.metadata`` of torch.distributed.checkpoint and Lightning's ``meta.pt`` - that every rank writes directly, not
    through a CheckpointIO plugin, so a kill during a save would leave a half-written ``last.ckpt/``. Here every rank
    writes into a hidden temporary folder next to the destination; once all have finished, rank 0 swaps it in
    (``swap_in``): the destination always names a complete checkpoint. Same arguments as ModelParallelStrategy.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Optional[Any] = None) -> None:
        if is_remote(filepath):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        final = os.path.abspath(self.broadcast(os.fspath(filepath)))
        folder = os.path.dirname(final)
        if self.is_global_zero:
            os.makedirs(folder, exist_ok=True)
            remove_stale_partials(folder)
        tmp = os.path.join(folder, self.broadcast(partial_name()))  # rank 0's name, on every rank
        needed = tensor_bytes(checkpoint)  # this rank's part, counted before the save takes the state out
        failure: Optional[BaseException] = None
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)
        except (Exception, CheckpointException) as e:  # torch.distributed.checkpoint's is a BaseException
            failure = e
        # A failed write on one rank alone (rank 0's meta.pt) would leave the others waiting in the next collective:
        # every rank learns whether any failed, and all stop together, the temporary folder removed.
        if self.reduce_boolean_decision(failure is not None, all=False):
            needed = int(self.reduce(torch.tensor(float(needed), device=self.root_device), reduce_op="sum").item())
            self.barrier("aah_checkpoint_failed")
            if self.is_global_zero:
                shutil.rmtree(tmp, ignore_errors=True)
                fsync_dir(folder)
            raise failed_save(failure, final, folder, needed)
        self.barrier("aah_checkpoint_written")
        if self.is_global_zero:
            swap_in(tmp, final)
        self.barrier("aah_checkpoint_swapped")

    def remove_checkpoint(self, filepath) -> None:
        path = os.fspath(filepath)
        if self.is_global_zero and os.path.islink(path):  # a swapped-in folder: the link and what it names
            target = os.path.realpath(path)
            os.remove(path)
            shutil.rmtree(target, ignore_errors=True)
            return
        super().remove_checkpoint(filepath)
