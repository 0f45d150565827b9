"""The class path earlier versions gave the FSDP2 strategy, kept so that their configs still load.

``configs/cluster/fsdp2.yaml`` of earlier versions, copies of it, and the ``config.yaml`` that every run saves in its
log folder name ``aah_lightning.lit.checkpointing.AtomicModelParallelStrategy``. It lives in ``lit/fsdp2_saves.py``;
nothing in the package imports this module.
"""

from aah_lightning.lit.fsdp2_saves import AtomicModelParallelStrategy

__all__ = ["AtomicModelParallelStrategy"]
