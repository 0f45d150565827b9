"""What training on several processes needs beyond Lightning's strategies (docs/scaling.md).

* ``prepare_model``: activation checkpointing, ``torch.compile`` of each block and, under ``ModelParallelStrategy``,
  FSDP2 (``fully_shard`` per block, then the whole GPT), applied once in ``configure_model``.
* ``WindowTableSync``: every rank must train with the same window table; a cheap check that they do.
* ``rng_state`` / ``set_rng_state`` / ``gather``: per-rank RNG states and data positions for the checkpoint, which
  only rank 0 writes.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.distributed as dist

from aah_lightning.errors import ConfigError


def distributed_world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def shutdown_process_group() -> None:
    """Destroy the default process group if one is up. Lightning leaves it to interpreter exit, where gloo's threads
    can be torn down in the wrong order and abort the process ("terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def gather(obj) -> list:
    """``obj`` of every rank, in rank order (all ranks must call this). One process: ``[obj]``."""
    world = distributed_world()
    if world == 1:
        return [obj]
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


# -- model preparation -------------------------------------------------------------------------------------------------
def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6 kept FSDP2 under _composable
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def prepare_model(module, compile_blocks: bool, activation_checkpointing: bool) -> None:
    """Apply activation checkpointing, block compilation and FSDP2 to ``module.model``, in that order (the order
    torchtitan uses: the compiled region includes the recomputation, and FSDP wraps the compiled block)."""
    gpt = module.model
    if activation_checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        # The wrapper's state-dict hooks drop its prefix, so checkpoints load with or without it.
        for i, block in enumerate(gpt.blocks):
            gpt.blocks[i] = checkpoint_wrapper(block)
    if compile_blocks:
        # One graph per (plan kind, grad mode, batch shape), maybe per layer: more than the default 8 of Block.forward.
        cfg = torch._dynamo.config
        name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # torch < 2.7
        setattr(cfg, name, max(getattr(cfg, name), 128))
        # DDP's graph splitting at bucket boundaries buys nothing for per-block graphs (DDP's own hooks already
        # overlap each block's gradients) and has broken on higher-order ops like flex (pytorch#137481).
        torch._dynamo.config.optimize_ddp = False
        # The forward, not the module: FSDP2's and DDP's hooks stay eager around the graph. fullgraph: a graph break
        # inside attention is an error, not a silent slowdown.
        for block in gpt.blocks:
            block.forward = torch.compile(block.forward, fullgraph=True, dynamic=False)
    # Set by ModelParallelStrategy before configure_model, None under the others (and absent from bare test modules).
    mesh = getattr(module, "device_mesh", None)
    if mesh is None:
        return
    tp = mesh["tensor_parallel"].size() if "tensor_parallel" in (mesh.mesh_dim_names or ()) else 1
    if tp > 1:
        # Nothing here splits layers across the tensor-parallel ranks: they would hold full replicas that never
        # average their gradients. ModelParallelStrategy() with "auto" sizes does exactly that on one node.
        raise ConfigError(
            f"ModelParallelStrategy has tensor_parallel_size={tp}, but aah shards with FSDP2 only: set "
            f"trainer.strategy.init_args.data_parallel_size to the world size ({mesh.size()}) and "
            f"tensor_parallel_size=1 (configs/cluster/fsdp2.yaml)"
        )
    dp_mesh = mesh["data_parallel"] if mesh.mesh_dim_names and "data_parallel" in mesh.mesh_dim_names else mesh
    fully_shard = _fully_shard()
    for block in gpt.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(gpt, mesh=dp_mesh)  # the rest: tied embedding / lm_head, final norm


# -- window tables -----------------------------------------------------------------------------------------------------
class WindowTableSync:
    """Asserts that every rank trains with the same window table.

    Policies decide from step numbers, seeded generators and all-reduced statistics, so their tables agree by
    construction; DDP is configured not to broadcast buffers (configs/cluster/ddp.yaml), so nothing would repair a
    rank that drifted, and one would silently train another model than the others.

    Each optimizer step every rank all-reduces (max) a checksum of its table and its negation: ``max - min`` is 0
    when all agree. That is a few tiny device ops and no host sync. The flag is read on the host only at steps where
    this rank's table changed, every ``check_every`` steps and before a checkpoint is written. Running the
    collective every step (not only on change) means a rank that changed while others did not cannot hang it.
    """

    def __init__(self, check_every: int = 100):
        self.check_every = check_every
        self._mismatch: torch.Tensor | None = None
        self._weights: torch.Tensor | None = None

    def enabled(self) -> bool:
        return distributed_world() > 1

    def update(self, windows: torch.Tensor, step: int, changed: bool) -> None:
        if not self.enabled():
            return
        if self._weights is None or self._weights.device != windows.device:
            # Position weights make the checksum see swapped entries, not only their sum.
            n = windows.numel()
            self._weights = torch.arange(1, n + 1, device=windows.device, dtype=torch.int64).view_as(windows)
        checksum = (windows.to(torch.int64) * self._weights).sum()
        both = torch.stack([checksum, -checksum])
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        spread = both[0] + both[1]  # max - min over ranks
        self._mismatch = spread if self._mismatch is None else torch.maximum(self._mismatch, spread)
        if changed or (self.check_every > 0 and step % self.check_every == 0):
            self.verify(windows, step)

    def verify(self, windows: torch.Tensor, step: int) -> None:
        if self._mismatch is None or not self.enabled():
            return
        if int(self._mismatch.item()) != 0:
            raise RuntimeError(
                f"the window table differs between ranks (seen by rank {dist.get_rank()} at optimizer step {step}; "
                f"its table: {windows.tolist()}). A window policy made a rank-dependent decision; every rank must "
                f"compute the same table"
            )


# -- RNG states --------------------------------------------------------------------------------------------------------
def rng_state() -> dict:
    """This process's Python, NumPy, torch (and CUDA) RNG states, as types ``torch.load(weights_only=True)`` reads."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def derived_rng_state(rank: int, step: int) -> dict:
    """The RNG state of a rank that a checkpoint has none for: Python, NumPy and torch (CUDA) generators seeded from
    the run's seed (``seed_everything``: ``PL_GLOBAL_SEED``), the rank and the step, the same on every resume."""
    base = int(os.environ.get("PL_GLOBAL_SEED", 0))
    seed = int(np.random.SeedSequence([base, rank, step]).generate_state(1)[0])
    saved = rng_state()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also every CUDA device
    state = rng_state()
    set_rng_state(saved)
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
