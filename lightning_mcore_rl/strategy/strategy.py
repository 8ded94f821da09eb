"""``MCoreRLStrategy``: megatron-core's schedules, DDP, optimizer and ``dist_checkpointing``
under a Lightning ``Trainer``.

A thin adapter over public Lightning hooks; the mechanics live in trainer-free modules
(:mod:`.schedule`, :mod:`.checkpoint`, :mod:`.optimizer`). The pitfalls each hook handles are
listed in ``docs/strategy.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import LRSchedulerConfig
from typing_extensions import override

from lightning_mcore_rl.megatron_defaults import pipeline_p2p_settings
from lightning_mcore_rl.strategy import checkpoint as ckpt
from lightning_mcore_rl.strategy.config import CheckpointConfig, MegatronDDPConfig, ParallelSizes
from lightning_mcore_rl.strategy.optimizer import (
    MegatronOptimizerAdapter,
    MegatronOptimizerSpec,
    resolve_optimizer_config,
)
from lightning_mcore_rl.strategy.precision import MCorePrecision, to_mcore_precision
from lightning_mcore_rl.strategy.schedule import (
    ForwardStepFunc,
    StepOutput,
    lm_forward_step,
    reduce_step_outputs,
    run_schedule,
    unwrap_model,
    wrap_chunks,
)

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallel

_DEFAULT_SEED = 1234
_PROCESS_EMULATION: list[Any] = []  # the process-lifetime cpu_emulation() context, entered once


def check_trainer_flags(
    accumulate_grad_batches: int,
    gradient_clip_val: float | None,
    gradient_clip_algorithm: str | None,
) -> float:
    """Validate the Trainer flags megatron implements itself; return ``OptimizerConfig.clip_grad``
    (``0.0`` — no clipping — when ``gradient_clip_val`` is None, NOT megatron's default 1.0)."""
    if accumulate_grad_batches != 1:
        raise ValueError(
            f"`Trainer(accumulate_grad_batches={accumulate_grad_batches})` is not supported by "
            "MCoreRLStrategy: one Lightning batch is one optimizer step. Put the samples of the "
            "whole global batch into each batch (DataLoader batch_size = global batch / DP); the "
            "strategy splits it into microbatches of `micro_batch_size`."
        )
    # The Trainer stores a GradClipAlgorithmType (a str enum): compare and report its value.
    gradient_clip_algorithm = getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)
    if gradient_clip_algorithm not in (None, "norm"):
        raise ValueError(
            f"`Trainer(gradient_clip_algorithm={gradient_clip_algorithm!r})` is not supported: "
            "megatron clips by the global gradient norm; use gradient_clip_algorithm='norm'."
        )
    return 0.0 if gradient_clip_val is None else float(gradient_clip_val)


def check_token_budget(
    max_tokens_per_microbatch: int | None, micro_batch_size: int, parallel: ParallelSizes
) -> None:
    """Validate ``max_tokens_per_microbatch`` against the other microbatching settings.

    Raises:
        ValueError: not a positive int (or None); given with ``micro_batch_size`` > 1 (the budget
            decides how many samples each microbatch holds); with pipeline parallelism but
            without ``sequence_packing`` (padded budget microbatches differ in shape).
    """
    if max_tokens_per_microbatch is None:
        return
    if (
        isinstance(max_tokens_per_microbatch, bool)
        or not isinstance(max_tokens_per_microbatch, int)
        or max_tokens_per_microbatch < 1
    ):
        raise ValueError(
            "`max_tokens_per_microbatch` must be a positive int or None, got "
            f"{max_tokens_per_microbatch!r}."
        )
    if micro_batch_size != 1:
        raise ValueError(
            f"`micro_batch_size={micro_batch_size}` contradicts "
            f"`max_tokens_per_microbatch={max_tokens_per_microbatch}`: with a token budget the "
            "budget decides how many samples each microbatch holds; leave micro_batch_size at 1."
        )
    if parallel.pp > 1 and not parallel.sequence_packing:
        raise ValueError(
            f"`max_tokens_per_microbatch` with `pipeline_model_parallel_size={parallel.pp}` needs "
            "`sequence_packing=True`: padded token-budget microbatches hold different numbers of "
            "samples, and megatron's pipeline p2p sends one shape for every microbatch."
        )


class MCoreRLStrategy(DDPStrategy):
    """Train megatron-core models (TP/PP/VPP/CP/SP/DP) with Lightning.

    One Lightning batch is this data-parallel rank's share of ONE global batch and ONE optimizer
    step; ``forward_backward`` splits it into microbatches and runs megatron's schedule.

    Args:
        tensor_model_parallel_size: TP size.
        pipeline_model_parallel_size: PP size.
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank (interleaved 1F1B).
        context_parallel_size: CP size (needs ``sequence_packing``).
        sequence_parallel: megatron sequence parallelism (needs TP > 1).
        sequence_packing: pack each microbatch into one THD row.
        use_distributed_optimizer: shard optimizer state and main params over DP.
        micro_batch_size: samples per microbatch for fixed-size microbatching.
        max_tokens_per_microbatch: token budget per microbatch (``None``: fixed-size
            microbatches). The ``loss_fn`` path then groups each DP rank's samples into
            microbatches of at most this many tokens (THD tokens with ``sequence_packing``, else
            rows x longest row), the same number on every DP rank; ``micro_batch_size`` must stay
            1 (a larger value contradicts the budget and raises). Pipeline parallelism needs
            ``sequence_packing`` with a budget. The default LM path (``forward_step``) has no
            per-sample lengths and rejects a budget.
        ddp: megatron DDP options.
        checkpoint: checkpoint format options.
        process_group_backend: ``"nccl"``/``"gloo"`` (default: from the device).
        cluster_environment: Lightning cluster environment (default: detected).
        timeout: process-group timeout.

    Accelerator, devices and precision come from the ``Trainer``; torch-DDP options do not exist
    here (megatron's DDP is configured by ``ddp``).
    """

    strategy_name = "mcore_rl"

    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: int | None = None,
        context_parallel_size: int = 1,
        sequence_parallel: bool = False,
        sequence_packing: bool = False,
        use_distributed_optimizer: bool = False,
        micro_batch_size: int = 1,
        max_tokens_per_microbatch: int | None = None,
        ddp: MegatronDDPConfig | None = None,
        checkpoint: CheckpointConfig | None = None,
        process_group_backend: str | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
    ) -> None:
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
            raise ValueError(
                f"`micro_batch_size` must be a positive int, got {micro_batch_size!r}."
            )
        self.parallel = ParallelSizes(
            tp=tensor_model_parallel_size,
            pp=pipeline_model_parallel_size,
            vpp=virtual_pipeline_model_parallel_size,
            cp=context_parallel_size,
            sequence_parallel=sequence_parallel,
            sequence_packing=sequence_packing,
        )
        check_token_budget(max_tokens_per_microbatch, micro_batch_size, self.parallel)
        self.max_tokens_per_microbatch = max_tokens_per_microbatch
        self.use_distributed_optimizer = use_distributed_optimizer
        self.micro_batch_size = micro_batch_size
        self.ddp_config = ddp if ddp is not None else MegatronDDPConfig()
        self.checkpoint_config = checkpoint if checkpoint is not None else CheckpointConfig()
        self._default_precision = MCorePrecision()
        self._chunks: list[torch.nn.Module] = []
        self._chunks_for: list[torch.nn.Module] = []
        super().__init__(
            cluster_environment=cluster_environment,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )

    # ---------------------------------------------------------------- environment and layout

    @property
    def vp_stages(self) -> list[int | None]:
        """The virtual-pipeline stage of each model chunk this rank builds (``[None]`` w/o VPP)."""
        return list(range(self.parallel.vpp)) if self.parallel.vpp else [None]

    @property
    def model_chunks(self) -> list[torch.nn.Module]:
        """The wrapped chunks megatron's schedule runs (DDP when fitting, ``Float16Module`` bf16)."""
        return self._chunks

    @property
    def megatron_optimizer(self) -> Any:
        """The megatron optimizer behind the Lightning optimizer (fitting only)."""
        return self._adapter().megatron_optimizer

    def transformer_config_kwargs(self) -> dict[str, Any]:
        """``TransformerConfig`` fields the strategy and ``Trainer(precision=...)`` own."""
        dtype = self.precision_plugin.params_dtype
        return {
            "tensor_model_parallel_size": self.parallel.tp,
            "pipeline_model_parallel_size": self.parallel.pp,
            "virtual_pipeline_model_parallel_size": self.parallel.vpp,
            "context_parallel_size": self.parallel.cp,
            "sequence_parallel": self.parallel.sequence_parallel,
            "bf16": self.precision_plugin.bf16,
            "params_dtype": dtype,
            "pipeline_dtype": dtype,
            **pipeline_p2p_settings(self.parallel.vpp),
        }

    @property
    def precision_plugin(self) -> MCorePrecision:
        """The megatron precision plugin (lazy ``"32-true"`` default: the setter must keep
        ``None``, or Lightning's connector would take it as the user's and ignore
        ``Trainer(precision=...)``)."""
        plugin = self._precision_plugin
        return plugin if isinstance(plugin, MCorePrecision) else self._default_precision

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        self._precision_plugin = None if plugin is None else to_mcore_precision(plugin)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """All TP/PP/CP ranks of a data-parallel replica must read the same samples."""
        from megatron.core import parallel_state as ps

        return {
            "num_replicas": ps.get_data_parallel_world_size(),
            "rank": ps.get_data_parallel_rank(),
        }

    @override
    def setup_environment(self) -> None:
        self.parallel.check_world_size(self.world_size)
        super().setup_environment()  # device, process group (reused if initialised), reset_seed
        if self.root_device.type == "cpu" and not _PROCESS_EMULATION:
            # For the whole process: Lightning runs hooks, validation and checkpointing from many
            # places after this point and no strategy hook brackets all of them.
            from lightning_mcore_rl.cpu import cpu_emulation

            context = cpu_emulation()
            context.__enter__()
            _PROCESS_EMULATION.append(context)
        self._init_model_parallel()

    def _init_model_parallel(self) -> None:
        """``initialize_model_parallel`` once per process, then seed megatron's RNG tracker with
        ``seed_everything``'s seed (``PL_GLOBAL_SEED``, default 1234)."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        p = self.parallel
        if ps.model_parallel_is_initialized():
            existing = (
                ps.get_tensor_model_parallel_world_size(),
                ps.get_pipeline_model_parallel_world_size(),
                ps.get_virtual_pipeline_model_parallel_world_size(),
                ps.get_context_parallel_world_size(),
            )
            if existing != (p.tp, p.pp, p.vpp, p.cp):
                raise RuntimeError(
                    f"megatron's parallel state is already initialised with (tp, pp, vpp, cp) = "
                    f"{existing}, but this strategy asks for {(p.tp, p.pp, p.vpp, p.cp)}; call "
                    "`megatron.core.parallel_state.destroy_model_parallel()` first."
                )
            return
        ps.initialize_model_parallel(
            tensor_model_parallel_size=p.tp,
            pipeline_model_parallel_size=p.pp,
            virtual_pipeline_model_parallel_size=p.vpp,
            context_parallel_size=p.cp,
        )
        # Under CPU emulation the "CUDA" generator IS torch's CPU generator: keep its state.
        rng_state = torch.get_rng_state()
        model_parallel_cuda_manual_seed(int(os.environ.get("PL_GLOBAL_SEED", _DEFAULT_SEED)))
        torch.set_rng_state(rng_state)

    # ---------------------------------------------------------------- model, optimizer

    @override
    def setup(self, trainer: Trainer) -> None:
        """Wrap chunks (no torch DDP, no ``_sync_module_states``: it would overwrite TP shards
        with rank 0's), build the megatron optimizer when fitting."""
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        raw = self._raw_chunks()
        for i, chunk in enumerate(raw):
            self._check_chunk_config(i, chunk)
        needs_ddp = fitting and not any(hasattr(c, "zero_grad_buffer") for c in self._chunks)
        if self._chunks_for != raw or needs_ddp:
            ddp = None
            if fitting:
                ddp = self.ddp_config.to_megatron(
                    precision=self.precision_plugin.precision,
                    use_distributed_optimizer=self.use_distributed_optimizer,
                )
            self._chunks = wrap_chunks(raw, bf16=self.precision_plugin.bf16, ddp_config=ddp)
            self._chunks_for = raw
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        """``configure_optimizers()`` -> megatron ``OptimizerConfig`` (or a
        :class:`MegatronOptimizerSpec` with a scheduler factory) -> megatron optimizer."""
        from megatron.core.optimizer import get_megatron_optimizer

        clip_grad = check_trainer_flags(
            trainer.accumulate_grad_batches,
            trainer.gradient_clip_val,
            trainer.gradient_clip_algorithm,
        )
        assert self.lightning_module is not None
        # an OptimizerConfig or a MegatronOptimizerSpec, outside Lightning's declared return type
        spec: object = self.lightning_module.configure_optimizers()
        if not isinstance(spec, MegatronOptimizerSpec):
            spec = MegatronOptimizerSpec(config=spec)
        config = resolve_optimizer_config(
            spec.config,
            clip_grad=clip_grad,
            bf16=self.precision_plugin.bf16,
            use_distributed_optimizer=self.use_distributed_optimizer,
        )
        adapter = MegatronOptimizerAdapter(get_megatron_optimizer(config, self._chunks))
        self.optimizers = [adapter]
        self.lr_scheduler_configs = []
        if spec.lr_scheduler is not None:
            self.lr_scheduler_configs = [_scheduler_config(spec.lr_scheduler(adapter))]

    @override
    def model_to_device(self) -> None:
        """No-op: megatron places parameters and its DDP buffers itself."""

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Zero the DDP grad buffers AND the optimizer's grads BEFORE the forward: megatron's fp32
        optimizer aliases ``param.grad = param.main_grad`` in ``step()``; a stale alias makes
        the next backward accumulate into the buffer twice (silently wrong gradients)."""
        for chunk in self._chunks:  # fitting: setup() wrapped every chunk in megatron DDP
            cast("DistributedDataParallel", chunk).zero_grad_buffer()
        self.megatron_optimizer.zero_grad()

    @override
    def optimizer_step(
        self,
        optimizer: Any,
        closure: Callable[[], Any],
        model: LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Lightning's step (closure = training step, then megatron's ``step()``), then log the
        pre-clip global ``grad_norm`` megatron computed (already model-parallel reduced)."""
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        last = optimizer.last_step if isinstance(optimizer, MegatronOptimizerAdapter) else None
        if last is not None and last.grad_norm is not None and self.lightning_module is not None:
            self.lightning_module.log("grad_norm", last.grad_norm, batch_size=1, on_step=True)
        return result

    # ---------------------------------------------------------------- one megatron step

    def forward_backward(
        self,
        batch: Mapping[str, torch.Tensor],
        forward_step_func: ForwardStepFunc = lm_forward_step,
        *,
        forward_only: bool = False,
    ) -> StepOutput:
        """Split this DP rank's batch into microbatches of ``micro_batch_size`` and run megatron's
        schedule with ``forward_step_func`` (default: LM loss on ``tokens``/``labels``).

        Returns:
            The step's loss and metrics, identical on every rank.

        Raises:
            ValueError: the strategy has ``max_tokens_per_microbatch`` (token budgets need the
                ``loss_fn`` path's per-sample lengths).
        """
        if self.max_tokens_per_microbatch is not None:
            raise ValueError(
                f"`max_tokens_per_microbatch={self.max_tokens_per_microbatch}` is supported on "
                "the `MCoreRLModule(loss_fn=...)` path only (batches with `input_lengths`); "
                "this `forward_step` path splits into fixed `micro_batch_size` microbatches. "
                "Set `max_tokens_per_microbatch=None` or use a `loss_fn`."
            )
        microbatches = split_microbatches(batch, self.micro_batch_size)
        first = next(iter(microbatches[0].values()))
        outputs = run_schedule(
            self._chunks,
            microbatches,
            forward_step_func,
            seq_length=first.shape[1],
            micro_batch_size=first.shape[0],
            forward_only=forward_only,
        )
        return reduce_step_outputs(outputs, device=self.root_device)

    # ---------------------------------------------------------------- checkpoints

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Sharded state dicts need the built, wrapped model and the optimizer."""
        return True

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return ckpt.sharded_model_state_dict([unwrap_model(c) for c in self._chunks])

    @override
    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return ckpt.sharded_optimizer_state_dict(
            self.megatron_optimizer,
            self.lightning_module_state_dict(),
            sharding=self.checkpoint_config.optimizer_sharding,
            is_loading=False,
        )

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Collective (all ranks): the whole Lightning dict into directory ``filepath``."""
        if storage_options is not None:
            raise TypeError(
                "MCoreRLStrategy.save_checkpoint does not take `storage_options`; "
                "configure checkpoints with `MCoreRLStrategy(checkpoint=CheckpointConfig(...))`."
            )
        path = Path(self.broadcast(str(filepath)))
        ckpt.save(checkpoint, path, atomic=self.checkpoint_config.atomic)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        ckpt.remove(Path(filepath))

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict:
        """Load into a template built from the live model (and optimizer when fitting): any TP/PP
        layout the weights were saved under works."""
        path = Path(self.broadcast(str(checkpoint_path)))
        model_state = self.lightning_module_state_dict()
        template: dict[str, Any] = {"state_dict": model_state}
        if self.optimizers:
            template["optimizer_states"] = [
                ckpt.sharded_optimizer_state_dict(
                    self.megatron_optimizer,
                    model_state,
                    sharding=self.checkpoint_config.optimizer_sharding,
                    is_loading=True,
                )
            ]
        assert self.lightning_module is not None
        safe = ckpt.user_types(dict(self.lightning_module.hparams))
        return ckpt.load(template, path, safe)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        parts = ckpt.split_chunk_state_dict(checkpoint["state_dict"], len(self._chunks))
        for chunk, part in zip(self._chunks, parts, strict=True):
            unwrap_model(chunk).load_state_dict(part, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        self._adapter().load_state_dict(checkpoint["optimizer_states"][0])

    @override
    def teardown(self) -> None:
        """No ``.cpu()`` of the module or optimizer state: on GPU it would break the aliasing
        between megatron DDP's buffers and the parameters. Megatron's parallel state is kept for
        later ``validate``/``fit`` calls in this process."""
        self.precision_plugin.teardown()
        assert self.accelerator is not None
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # ---------------------------------------------------------------- helpers

    def _raw_chunks(self) -> list[torch.nn.Module]:
        module = self.lightning_module
        chunks = getattr(module, "chunks", None)
        if chunks is None:
            raise TypeError(
                f"MCoreRLStrategy needs a LightningModule with megatron model chunks in "
                f"`self.chunks` (subclass `MCoreRLModule`); {type(module).__name__} has none "
                "after `configure_model`."
            )
        if len(chunks) != len(self.vp_stages):
            raise ValueError(
                f"The module built {len(chunks)} model chunk(s) but the strategy runs "
                f"{len(self.vp_stages)} (virtual_pipeline_model_parallel_size="
                f"{self.parallel.vpp}); build one chunk per entry of `strategy.vp_stages`."
            )
        return list(chunks)

    def _check_chunk_config(self, index: int, chunk: torch.nn.Module) -> None:
        config = getattr(chunk, "config", None)
        if config is None:
            raise TypeError(f"Model chunk {index} ({type(chunk).__name__}) has no megatron config.")
        for key, expected in self.transformer_config_kwargs().items():
            actual = getattr(config, key)
            if actual != expected:
                raise ValueError(
                    f"Model chunk {index}: `TransformerConfig.{key}={actual!r}` but the strategy "
                    f"and Trainer set {expected!r}; build the config with "
                    "`strategy.transformer_config_kwargs()` (see `MCoreRLModule.transformer_config`)."
                )

    def _adapter(self) -> MegatronOptimizerAdapter:
        if not self.optimizers or not isinstance(self.optimizers[0], MegatronOptimizerAdapter):
            raise RuntimeError("The megatron optimizer exists only while fitting, after `setup`.")
        return self.optimizers[0]


def split_microbatches(
    batch: Mapping[str, torch.Tensor], micro_batch_size: int
) -> list[dict[str, torch.Tensor]]:
    """Split every tensor of ``batch`` (``[B, ...]``) into ``B / micro_batch_size`` microbatches."""
    sizes = {key: value.shape[0] for key, value in batch.items()}
    if not sizes or len(set(sizes.values())) != 1:
        raise ValueError(f"The batch's tensors must share dim 0 (samples), got sizes {sizes}.")
    size = next(iter(sizes.values()))
    if size % micro_batch_size != 0:
        raise ValueError(
            f"This rank's batch has {size} samples, not divisible by micro_batch_size="
            f"{micro_batch_size}; use a DataLoader batch_size that is a multiple of it."
        )
    return [
        {key: value[i : i + micro_batch_size] for key, value in batch.items()}
        for i in range(0, size, micro_batch_size)
    ]


def _scheduler_config(scheduler: Any) -> LRSchedulerConfig:
    """A scheduler or a Lightning scheduler dict -> ``LRSchedulerConfig``."""
    if isinstance(scheduler, Mapping):
        if "scheduler" not in scheduler:
            raise ValueError("A scheduler dict from the factory needs a 'scheduler' key.")
        return LRSchedulerConfig(**scheduler)
    return LRSchedulerConfig(scheduler=scheduler)


def register_strategy() -> None:
    """Register ``"mcore_rl"`` in Lightning's ``StrategyRegistry`` (idempotent)."""
    from lightning.pytorch.strategies import StrategyRegistry

    if MCoreRLStrategy.strategy_name not in StrategyRegistry:
        StrategyRegistry.register(
            MCoreRLStrategy.strategy_name,
            MCoreRLStrategy,
            description="megatron-core TP/PP/VPP/CP/DP training (lightning-mcore-rl)",
        )
