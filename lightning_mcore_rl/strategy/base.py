"""Lightning's process plumbing for a strategy with one process per device and no torch DDP:
what `DDPStrategy` does for its processes (launch, ranks, world group, collectives), without
wrapping the module; `MCoreRLStrategy` adds megatron's groups, model and optimizer."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override


class ProcessGroupStrategy(ParallelStrategy):
    """One process per device (launched like `DDPStrategy`'s), the world process group, and
    Lightning's collectives over it; the model is left as the subclass wraps it.

    Args:
        process_group_backend: `"nccl"`/`"gloo"` (default: from the device).
        cluster_environment: Lightning cluster environment (default: detected).
        timeout: timeout of the world process group and of `world_group`."""

    def __init__(
        self,
        process_group_backend: str | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._world_group: Any = None
        self.num_nodes = 1
        super().__init__(cluster_environment=cluster_environment)

    @property
    def world_group(self) -> Any:
        """A group of all ranks the strategy created with ITS timeout (`None` before
        `setup_environment`), for the strategy's own collectives."""
        # a world group created before the Trainer (with another timeout) never bounds them
        return self._world_group

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        """Lightning injects `DistributedSampler`s (`distributed_sampler_kwargs`) and syncs
        logged values when asked."""
        return True

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @override
    def _configure_launcher(self) -> None:
        """Lightning's script launcher on every process, as `DDPStrategy` does."""
        # It spawns the other local ranks only where the environment does not create them, and on
        # EVERY rank sets torch's intra-op threads to `cpus // local processes` unless
        # OMP_NUM_THREADS is set. Built on the launching process only, the launched ranks kept
        # torch's default count: oversubscribed cores and TP ranks whose replicated parameters
        # round differently.
        assert self.cluster_environment is not None
        self._launcher = _SubprocessScriptLauncher(
            self.cluster_environment, self.num_processes, self.num_nodes
        )

    @override
    def setup_environment(self) -> None:
        """The accelerator, this process's ranks and the world process group."""
        super().setup_environment()
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(
            self.node_rank * self.num_processes + self.local_rank
        )
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        if self._world_group is None:  # collective: every rank creates it once
            self._world_group = dist.new_group(backend=backend, timeout=self._timeout)

    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier(group=self._world_group)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src, group=self._world_group)
        return holder[0]

    @override
    def reduce(
        self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Any:
        if isinstance(tensor, torch.Tensor):
            group = group if group is not None else self._world_group
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor


__all__ = ["ProcessGroupStrategy"]
