"""`MCoreRLStrategy`: megatron-core's schedules, DDP, optimizer and `dist_checkpointing` under a
Lightning `Trainer`."""

# A thin adapter over public Lightning hooks (a `ParallelStrategy`, like Lightning's
# `ModelParallelStrategy`). The step's mechanics live in the trainer-free `train/step.py`, the rest
# in base.py (processes, world group), model.py, checkpoint.py and optimizer.py; the pitfalls each
# hook handles are in docs/strategy.md.

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_mcore_rl._compat import filter_expected_warnings
from lightning_mcore_rl.rank_errors import install_rank_excepthook
from lightning_mcore_rl.reliability.agreement import StepBoundary
from lightning_mcore_rl.reliability.nonfinite import NonFiniteGuard
from lightning_mcore_rl.reliability.processes import (
    RankTable,
    collective_failure,
    connect_world,
    die_with_parent,
    is_collective_failure,
)
from lightning_mcore_rl.reliability.signals import TerminationRequest
from lightning_mcore_rl.reliability.threads import set_intra_op_threads
from lightning_mcore_rl.strategy import checkpoint as ckpt
from lightning_mcore_rl.strategy.backend import enter_run_backends
from lightning_mcore_rl.strategy.base import ProcessGroupStrategy
from lightning_mcore_rl.strategy.config import (
    CheckpointConfig,
    LogprobKernelConfig,
    MegatronDDPConfig,
    MicrobatchConfig,
    ParallelSizes,
    ReliabilityConfig,
    accept_flat_arguments,
)
from lightning_mcore_rl.strategy.draft_training import (
    DraftState,
    build_draft,
    draft_checkpoint_state,
    load_draft_checkpoint_state,
    step_draft,
)
from lightning_mcore_rl.strategy.model import WrappedChunks, checked_chunks
from lightning_mcore_rl.strategy.optimizer import (
    MegatronOptimizerAdapter,
    MegatronStepResult,
    build_optimizer,
    check_trainer_flags,
)
from lightning_mcore_rl.strategy.parallel import check_strategy_args, init_model_parallel
from lightning_mcore_rl.strategy.precision import MCorePrecision, to_mcore_precision
from lightning_mcore_rl.strategy.resume import ResumeGuardLauncher, check_resumed_fit_trained
from lightning_mcore_rl.strategy.step_runner import StepRunner
from lightning_mcore_rl.strategy.teacher import HostedTeacher

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel

    from lightning_mcore_rl.strategy.step_runner import StepDeclaration
    from lightning_mcore_rl.train import (
        Microbatching,
        ParallelGroups,
        PolicyConfig,
        StepContext,
        StepOutput,
    )
    from lightning_mcore_rl.train.post_processors import PostProcessingFunction


_PEER_GRACE_S = 5.0
"""After a failed collective: how long the peers on this host get to exit by themselves (and
print their own message) before they are killed."""


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What the strategy knows of the latest training step, published once its optimizer step
    ended (`MCoreRLStrategy.step_record`): all `TrainingStatistics` reads of the strategy."""

    skipped: bool  # the non-finite policy skipped it: nothing was updated
    skip_cause: str  # why ("" when it was not skipped)
    skipped_steps: int  # steps skipped so far in this run, this one included
    grad_norm: float | None  # megatron's pre-clip global gradient norm (None: not computed)
    # the slowest rank's wall time of the step before it (s), agreed in this step's first pass
    previous_step_time: float | None


class MCoreRLStrategy(ProcessGroupStrategy):
    """Train megatron-core models (TP/PP/VPP/CP/SP/DP) with Lightning: one Lightning batch is
    this DP rank's share of ONE global batch and ONE optimizer step (`forward_backward`).

    Args:
        tensor_model_parallel_size: TP size.
        pipeline_model_parallel_size: PP size.
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank (interleaved 1F1B).
        context_parallel_size: CP size (needs `microbatching.sequence_packing`).
        expert_model_parallel_size: EP size (`etp * ep * pp` must divide the world size).
        expert_tensor_parallel_size: TP size inside each expert (`None`: TP).
        sequence_parallel: megatron sequence parallelism (needs TP > 1).
        microbatching: micro-batch size, token budget and sequence packing (`MicrobatchConfig`).
        ddp: megatron DDP options and the distributed optimizer (`MegatronDDPConfig`).
        checkpoint: checkpoint format options (`CheckpointConfig`).
        reliability: process-group timeouts, the non-finite policy (`ReliabilityConfig`).
        logprobs: the logprob kernels: fused linear logprobs, chunk size (`LogprobKernelConfig`)."""

    # Accelerator, devices and precision come from the `Trainer`, a cluster environment from
    # `Trainer(plugins=[...])`. The deprecated flat keywords (`FLAT_ARGUMENTS`, config.py) are
    # folded into their groups with one `FutureWarning` per construction.

    strategy_name = "mcore_rl"

    @accept_flat_arguments
    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: int | None = None,
        context_parallel_size: int = 1,
        expert_model_parallel_size: int = 1,
        expert_tensor_parallel_size: int | None = None,
        sequence_parallel: bool = False,
        microbatching: MicrobatchConfig | None = None,
        ddp: MegatronDDPConfig | None = None,
        checkpoint: CheckpointConfig | None = None,
        reliability: ReliabilityConfig | None = None,
        logprobs: LogprobKernelConfig | None = None,
    ) -> None:
        from lightning_mcore_rl.train import Microbatching, PolicyConfig

        check_strategy_args(
            microbatching=microbatching,
            ddp=ddp,
            checkpoint=checkpoint,
            reliability=reliability,
            logprobs=logprobs,
        )
        batching = microbatching if microbatching is not None else MicrobatchConfig()
        sequence_packing = batching.sequence_packing
        self.parallel = ParallelSizes(
            tp=tensor_model_parallel_size,
            pp=pipeline_model_parallel_size,
            vpp=virtual_pipeline_model_parallel_size,
            cp=context_parallel_size,
            ep=expert_model_parallel_size,
            etp=expert_tensor_parallel_size,
            sequence_parallel=sequence_parallel,
            sequence_packing=sequence_packing,
        )
        self.microbatching: Microbatching = Microbatching(
            micro_batch_size=batching.micro_batch_size,
            max_tokens_per_microbatch=batching.max_tokens_per_microbatch,
            sequence_packing=sequence_packing,
            equal_shapes=pipeline_model_parallel_size > 1,
            sequence_parallel=sequence_parallel,
        )
        self.ddp_config = ddp if ddp is not None else MegatronDDPConfig()
        self.checkpoint_config = checkpoint if checkpoint is not None else CheckpointConfig()
        self.reliability = reliability if reliability is not None else ReliabilityConfig()
        self.logprobs = logprobs if logprobs is not None else LogprobKernelConfig()
        self.use_distributed_optimizer = self.ddp_config.use_distributed_optimizer
        self.use_fused_linear_logprobs = self.logprobs.use_fused_linear_logprobs
        self._policy = PolicyConfig(
            sequence_packing=sequence_packing,
            logprob_chunk_size=self.logprobs.logprob_chunk_size,
            fused_gradient_in_forward=self.logprobs.fused_gradient_in_forward,
        )
        self._default_precision = MCorePrecision()
        self._groups: ParallelGroups | None = None
        self._context: StepContext | None = None
        self._backend = contextlib.ExitStack()
        self._wrapped = WrappedChunks()
        self._chunks: list[torch.nn.Module] = []
        self.teacher = HostedTeacher()  # the module's frozen teacher (strategy/teacher.py)
        self.draft = DraftState()  # the module's EAGLE draft, trained in the step (draft.py)
        rel = self.reliability
        self.nonfinite_guard = NonFiniteGuard.from_config(rel)
        self.termination = TerminationRequest()  # SIGTERM at step boundaries (signals.py)
        # what each training step's first agreement carries: SIGTERM, the previous step's time
        self.step_boundary = StepBoundary(self.termination)
        self.step_record: StepRecord | None = None  # the latest training step (optimizer_step)
        self._ranks: RankTable | None = None
        self._fit_start_step = 0  # global_step when training started (resumed: the checkpoint's)
        super().__init__(rel.process_group_backend, None, rel.timeout)

    # ---------------------------------------------------------------- layout

    @property
    def groups(self) -> ParallelGroups:
        """This rank's megatron groups, read once in ``setup_environment``."""
        if self._groups is None:
            raise RuntimeError("The parallel groups exist only after `setup_environment`.")
        return self._groups

    @property
    def vp_stages(self) -> list[int | None]:
        """The virtual-pipeline stage of each model chunk this rank builds (``[None]`` w/o VPP)."""
        return list(range(self.parallel.vpp)) if self.parallel.vpp else [None]

    @property
    def model_chunks(self) -> list[torch.nn.Module]:
        """The wrapped chunks megatron's schedule runs (DDP when fitting, `Float16Module` bf16)."""
        return self._chunks

    @property
    def megatron_optimizer(self) -> Any:
        """The megatron optimizer behind the Lightning optimizer (fitting only)."""
        return self._adapter().megatron_optimizer

    @property
    def last_optimizer_step(self) -> MegatronStepResult | None:
        """``(update_successful, grad_norm, num_zeros)`` of the latest optimizer step."""
        optimizer = self.optimizers[0] if self.optimizers else None
        return optimizer.last_step if isinstance(optimizer, MegatronOptimizerAdapter) else None

    def agree_last_step_time(self) -> float | None:
        """The last training step's wall time, the slowest rank's (one all-reduce, every rank)."""
        # it has no next step whose agreement could carry it
        return self.step_boundary.finish(self.root_device, self.world_group)

    @property
    def step_context(self) -> StepContext:
        """The frozen `StepContext` every pass runs with, built once in `setup`."""
        if self._context is None:
            raise RuntimeError("The step context exists only after the strategy's `setup`.")
        return self._context

    def policy_config(self) -> PolicyConfig:
        """The post-processors' ``PolicyConfig`` (packing, logprob chunk size)."""
        return self._policy

    def transformer_config_kwargs(self) -> dict[str, Any]:
        """``TransformerConfig`` fields the strategy and ``Trainer(precision=...)`` own."""
        plugin = self.precision_plugin
        return self.parallel.transformer_config_kwargs(plugin.bf16, plugin.params_dtype)

    def run_config(self) -> dict[str, Any]:
        """The run's layout, precision and micro-batching (logged as hyperparameters)."""
        return {
            "world_size": self.world_size,
            **self.parallel.hparams(),
            "data_parallel_size": self.world_size // self.parallel.model_parallel_size,
            "use_distributed_optimizer": self.use_distributed_optimizer,
            "micro_batch_size": self.microbatching.micro_batch_size,
            "max_tokens_per_microbatch": self.microbatching.max_tokens_per_microbatch,
            "use_fused_linear_logprobs": self.use_fused_linear_logprobs,
            "logprob_chunk_size": self._policy.logprob_chunk_size,
            "precision": self.precision_plugin.precision,
        }

    # ---------------------------------------------------------------- Lightning plumbing

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """All TP/PP/CP ranks of a data-parallel replica must read the same samples."""
        return {"num_replicas": self.groups.dp_size, "rank": self.groups.dp_rank}

    @property
    @override
    def precision_plugin(self) -> MCorePrecision:
        """The megatron precision plugin (lazy `"32-true"` default)."""
        # lazy: the setter must keep `None`, or Lightning's connector would take it as the user's
        # and ignore `Trainer(precision=...)`
        plugin = self._precision_plugin
        return plugin if isinstance(plugin, MCorePrecision) else self._default_precision

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else to_mcore_precision(plugin)

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        self._launcher = ResumeGuardLauncher(self._launcher)  # ckpt_path="last": strategy/resume.py

    @override
    def setup_environment(self) -> None:
        """Device, process group, the run's backends, megatron's groups (once per process) and
        the `ParallelGroups` passed down from here."""
        # The world group is connected here (`reliability.processes.connect_world`: rendezvous
        # bounded by `rendezvous_timeout`, collectives by `timeout`) before Lightning's, which then
        # finds it. The backends (megatron's no-TE fixes without Transformer Engine, the CPU
        # emulation on CPU) are left in `teardown`. An error raised on every rank prints one
        # traceback, rank 0's (`install_rank_excepthook`); forked processes die with the rank;
        # every rank's host and pid are gathered for the failure messages.
        filter_expected_warnings(cpu=self.root_device.type == "cpu")
        world_size = self.num_nodes * self.num_processes
        self.parallel.check_world_size(world_size)
        assert self.cluster_environment is not None
        env = self.cluster_environment
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        self.parallel.check_backend(backend, self.root_device.type)  # before any collective
        rank = self.node_rank * self.num_processes + self.local_rank  # as ProcessGroupStrategy
        connect_world(
            env.main_address, env.main_port, backend, rank, world_size, timeout=self._timeout,
            rendezvous_timeout=self.reliability.rendezvous_limit,
        )  # fmt: skip
        super().setup_environment()
        set_intra_op_threads(self.reliability.intra_op_threads, self.world_group, self.root_device)
        install_rank_excepthook()  # after torch's own hook (set by init_process_group)
        die_with_parent()
        if self._ranks is None:
            self._ranks = RankTable.gather(self.world_group)
        enter_run_backends(self._backend, self.root_device.type)
        self._groups = init_model_parallel(self.parallel, self._timeout)

    # ---------------------------------------------------------------- model, optimizer

    @override
    def setup(self, trainer: Trainer) -> None:
        """Wrap chunks, build the megatron optimizer when fitting, and the frozen step context
        (the module's `sampling_params()` asked once, here)."""
        # no torch DDP, no parameter broadcast: it would overwrite TP shards with rank 0's
        from lightning_mcore_rl.train import StepContext

        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        sampling = getattr(module, "sampling_params", None)
        self._context = StepContext(
            self.groups, self.microbatching, self._policy, self.use_fused_linear_logprobs,
            sampling_params=sampling() if callable(sampling) else None, device=self.root_device,
            world_group=self.world_group, defer_fp32_logits=self.logprobs.defer_fp32_logits,
        )  # fmt: skip
        fitting = trainer.state.fn == TrainerFn.FITTING
        expected = self.transformer_config_kwargs()
        raw = checked_chunks(self.lightning_module, self.vp_stages, expected)
        plugin = self.precision_plugin
        self.teacher.setup(
            self.lightning_module, self.vp_stages, expected, bf16=plugin.bf16,
            device=self.root_device,
        )  # fmt: skip
        ddp = None
        if fitting:
            ddp = self.ddp_config.to_megatron(precision=plugin.precision)
        self._chunks = self._wrapped.update(raw, bf16=plugin.bf16, ddp_config=ddp)
        if fitting:
            self.setup_optimizers(trainer)
            self.draft = build_draft(
                module, self.groups, ddp, self.megatron_optimizer.config,
                float(trainer.gradient_clip_val or 0.0), bf16=plugin.bf16,
            )  # fmt: skip
            self._context = dataclasses.replace(
                self._context, draft_model=self.draft.model, train_draft=self.draft.train_draft
            )
        self.setup_precision_plugin()

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        """`configure_optimizers()` -> `OptimizerConfig` (or `MegatronOptimizerSpec`) -> megatron
        optimizer."""
        clip_grad = check_trainer_flags(
            trainer.accumulate_grad_batches,
            trainer.gradient_clip_val,
            trainer.gradient_clip_algorithm,
        )
        assert self.lightning_module is not None
        adapter, schedulers = build_optimizer(
            self.lightning_module.configure_optimizers(),
            self._chunks,
            clip_grad=clip_grad,
            bf16=self.precision_plugin.bf16,
            use_distributed_optimizer=self.use_distributed_optimizer,
        )
        adapter.use_guard(self.nonfinite_guard, self.root_device, self.world_group)
        self.optimizers = [adapter]
        self.lr_scheduler_configs = schedulers

    @override
    def model_to_device(self) -> None:
        """No-op: megatron places parameters and its DDP buffers itself."""

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Zero the DDP grad buffers AND the optimizer's grads BEFORE the forward."""
        # megatron's fp32 optimizer aliases `param.grad = param.main_grad` in `step()`; a stale
        # alias makes the next backward accumulate into the buffer twice (silently wrong grads)
        for chunk in self._chunks:  # fitting: setup() wrapped every chunk in megatron DDP
            cast("DistributedDataParallel", chunk).zero_grad_buffer()
        self.megatron_optimizer.zero_grad()
        self.nonfinite_guard.begin_step()
        self.step_boundary.open()  # agreed in the step's first pass: no collective here

    @override
    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        """Lightning's optimizer step, then the step's `StepRecord`; its end ends the step's
        wall time (`step_time`)."""
        try:
            out = super().optimizer_step(optimizer, closure, model, **kwargs)
            last = self.last_optimizer_step
            # the draft steps with its policy (a run without one never enters strategy/draft.py)
            if self.draft.model is not None and (last is None or last.update_successful):
                step_draft(self.draft, self.groups)
            guard = self.nonfinite_guard
            self.step_record = StepRecord(
                skipped=guard.step_skipped,
                skip_cause=guard.last_skip_cause if guard.step_skipped else "",
                skipped_steps=guard.skipped_steps,
                grad_norm=last.grad_norm if last is not None else None,
                previous_step_time=self.step_boundary.previous_step_time,
            )
            return out
        finally:
            self.step_boundary.stop()

    @override
    def on_train_start(self) -> None:
        """From here SIGTERM is acted on at a step boundary, on every rank at once."""
        # after Lightning registered its handler, which `TerminationRequest` calls once agreed
        self.step_boundary.reset()
        self.termination.install()
        self._fit_start_step = self._trainer().global_step
        self.nonfinite_guard.begin_fit()

    @override
    def on_train_end(self) -> None:
        """A fit that trained nothing is an error: resumed past its bound, or every step skipped
        by the non-finite policy before its limit."""
        self.termination.restore()
        check_resumed_fit_trained(self._trainer(), self._fit_start_step)
        self.nonfinite_guard.check_fit_end()

    @override
    def on_exception(self, exception: BaseException) -> None:
        """After an agreed SIGTERM: save `last` in the first `ModelCheckpoint`'s directory and
        exit with `128 + signum`; a failed collective is re-raised as `CollectiveFailure`."""
        # Lightning raises `SIGTERMException` on every rank at the same step end, so the save (a
        # collective) is matched. `CollectiveFailure` names this rank, the global step and every
        # peer's state; the peers left on this host are killed at exit, after a grace period.
        signum = self.termination.agreed
        # Only after training started (a SIGTERM) or set-up ran (the rank table) is the module
        # attached to its Trainer: an error raised in `fit`'s launch reaches here without one.
        if signum is not None and isinstance(exception, SIGTERMException):
            self._save_last(self._trainer())
            self.termination.restore()
            exception.code = 128 + signum
            return
        self.termination.restore()
        if self._ranks is not None and is_collective_failure(exception):
            error = collective_failure(exception, self._ranks, self._trainer().global_step)
            self._ranks.end_local_peers_at_exit(grace_s=_PEER_GRACE_S)
            raise error from exception

    # ---------------------------------------------------------------- the step

    def forward_backward(
        self, module: StepDeclaration, batch: Mapping[str, Any], *, forward_only: bool = False
    ) -> StepOutput:
        """One global batch through `run_global_batch` (the module's `loss_post_processor(None)`
        or its `forward_step`): the step's loss and metrics, identical on every rank."""
        return self._runner(self._chunks).forward_backward(module, batch, forward_only=forward_only)

    def forward_only(
        self,
        batch: Mapping[str, Any],
        post_processor: PostProcessingFunction,
        *,
        teacher: bool = False,
    ) -> dict[str, torch.Tensor]:
        """A forward-only post-processor pass (dropout off) on the policy's chunks (`teacher`: the
        hosted teacher's): per-sample outputs in the batch's order, on every rank."""
        chunks = self.teacher.select(teacher, self._chunks)
        return self._runner(chunks).forward_only(batch, post_processor)

    # ---------------------------------------------------------------- checkpoints

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Sharded state dicts need the built, wrapped model and the optimizer."""
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        policy = self._checkpoints().model_state()
        teacher = self.teacher.state_dict(self.lightning_module)
        return {**policy, **teacher, **draft_checkpoint_state(self.draft)}

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self._checkpoints().optimizer_state()

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Collective (all ranks): the whole Lightning dict into directory ``filepath``."""
        path = Path(self.broadcast(str(filepath)))
        self._checkpoints().save(checkpoint, path, storage_options)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        ckpt.remove(Path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict:
        """Into this run's sharded state: the weights from any layout, the optimizer's layout
        changes checked on every rank first."""
        assert self.lightning_module is not None
        path, hparams = Path(self.broadcast(str(checkpoint_path))), self.lightning_module.hparams
        return self._checkpoints().load(path, self.lightning_module_state_dict(), hparams)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        rest = load_draft_checkpoint_state(self.draft, checkpoint["state_dict"])
        policy = self.teacher.load_state_dict(self.lightning_module, rest)
        self._checkpoints().load_model(policy, strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._adapter().load_state_dict(checkpoint["optimizer_states"][0])

    @override
    def teardown(self) -> None:
        """Exit the run's backends; megatron's parallel state stays for later calls."""
        # no `.cpu()` of the module or optimizer state: on GPU it would break the aliasing between
        # megatron DDP's buffers and the parameters
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()
        self._backend.close()
        self.termination.restore()

    # ---------------------------------------------------------------- helpers

    def _save_last(self, trainer: Trainer) -> None:
        """Collective: ``trainer.save_checkpoint`` to the first ``ModelCheckpoint``'s ``last``."""
        from lightning.pytorch.callbacks import ModelCheckpoint

        callback = trainer.checkpoint_callback
        if not isinstance(callback, ModelCheckpoint) or callback.dirpath is None:
            rank_zero_warn(
                "SIGTERM: no `ModelCheckpoint` directory, so no `last` checkpoint saved."
            )
            return
        name = f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
        trainer.save_checkpoint(Path(callback.dirpath) / name)

    def _trainer(self) -> Trainer:
        """The module's Trainer (attached once ``fit``'s launch runs the trainer function)."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError("MCoreRLStrategy has no LightningModule connected yet.")
        return module.trainer

    def _runner(self, chunks: list[torch.nn.Module]) -> StepRunner:
        return StepRunner(chunks, self.step_context, self.nonfinite_guard, self.step_boundary)

    def _checkpoints(self) -> ckpt.StrategyCheckpoints:
        optimizer = self.megatron_optimizer if self.optimizers else None
        return ckpt.StrategyCheckpoints(self._chunks, optimizer, self.checkpoint_config,
                                        self.run_config())  # fmt: skip

    def _adapter(self) -> MegatronOptimizerAdapter:
        if not self.optimizers or not isinstance(self.optimizers[0], MegatronOptimizerAdapter):
            raise RuntimeError("The megatron optimizer exists only while fitting, after `setup`.")
        return self.optimizers[0]


def register_strategy() -> None:
    """Register ``"mcore_rl"`` in Lightning's ``StrategyRegistry`` (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    if MCoreRLStrategy.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(
            MCoreRLStrategy.strategy_name,
            MCoreRLStrategy,
            description="megatron-core TP/PP/VPP/CP/DP training (lightning-mcore-rl)",
        )


__all__ = ["MCoreRLStrategy", "StepRecord", "check_trainer_flags", "register_strategy"]
