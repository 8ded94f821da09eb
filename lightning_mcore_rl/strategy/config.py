"""Typed configuration of `MCoreRLStrategy`, validated once each in `__post_init__`."""

# Plain dataclasses without megatron imports, so LightningCLI/jsonargparse can build them from
# YAML and `import lightning_mcore_rl` stays cheap.

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypeVar, cast

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_mcore_rl.reliability.nonfinite import (
    NonFinitePolicy,
    check_policy,
    check_update_options,
)
from lightning_mcore_rl.reliability.threads import check_intra_op_threads

PrecisionFlag = Literal["32-true", "bf16-mixed", "bf16-true"]
SUPPORTED_PRECISION: tuple[str, ...] = ("32-true", "bf16-mixed", "bf16-true")


@dataclass(frozen=True)
class MegatronDDPConfig:
    """The megatron `DistributedDataParallelConfig` fields users tune: the strategy's `ddp` group.

    Attributes:
        use_distributed_optimizer: shard optimizer state and main params over DP (megatron's).
        grad_reduce_in_fp32: reduce (and accumulate) gradients in fp32 (`None`: by precision).
        overlap_grad_reduce: overlap the DP gradient reduction with the backward (GPU streams).
        overlap_param_gather: overlap the distributed optimizer's parameter all-gather.
        bucket_size: gradient bucket size in elements (`None`: megatron's default).
        average_in_collective: average inside the collective instead of pre-scaling by 1/DP.
        check_for_nan_in_grad: raise on NaN gradients before the reduction.
    """

    # the other `DistributedDataParallelConfig` fields keep megatron's defaults

    # also megatron's `OptimizerConfig` flag of the same name
    use_distributed_optimizer: bool = False
    # `None`: True for "32-true" and "bf16-mixed", False for "bf16-true" (the only difference
    # between the two bf16 flags, see docs/strategy.md)
    grad_reduce_in_fp32: bool | None = None
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: int | None = None
    average_in_collective: bool = False
    check_for_nan_in_grad: bool = False

    def __post_init__(self) -> None:
        for name in ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
                     "average_in_collective", "check_for_nan_in_grad"):  # fmt: skip
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(
                    f"`MegatronDDPConfig.{name}` must be a bool, got {type(value).__name__}."
                )
        if self.grad_reduce_in_fp32 is not None and not isinstance(self.grad_reduce_in_fp32, bool):
            raise TypeError("`MegatronDDPConfig.grad_reduce_in_fp32` must be a bool or None.")
        if isinstance(self.bucket_size, bool) or not isinstance(
            self.bucket_size, (int, type(None))
        ):
            raise TypeError("`MegatronDDPConfig.bucket_size` must be an int or None.")
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(
                f"`MegatronDDPConfig.bucket_size` must be positive or None, got {self.bucket_size}."
            )

    def to_megatron(self, *, precision: str) -> Any:
        """The megatron `DistributedDataParallelConfig` for `precision`."""
        from megatron.core.distributed import DistributedDataParallelConfig

        in_fp32 = self.grad_reduce_in_fp32
        if in_fp32 is None:
            in_fp32 = precision != "bf16-true"
        return DistributedDataParallelConfig(
            grad_reduce_in_fp32=in_fp32,
            overlap_grad_reduce=self.overlap_grad_reduce,
            overlap_param_gather=self.overlap_param_gather,
            bucket_size=self.bucket_size,
            average_in_collective=self.average_in_collective,
            check_for_nan_in_grad=self.check_for_nan_in_grad,
            use_distributed_optimizer=self.use_distributed_optimizer,
        )


@dataclass(frozen=True)
class CheckpointConfig:
    """How checkpoints are written with megatron `dist_checkpointing`.

    Attributes:
        optimizer_sharding: distributed-optimizer format saved: `"dp_reshardable"`/`"fully_reshardable"`.
        atomic: write into a temporary sibling directory, renamed into place when all ranks finish.
    """

    # "dp_reshardable" is fast; a resume needs the saved TP/PP/VPP/CP sizes (DP may change:
    # another layout raises `ValueError` naming "fully_reshardable"). "fully_reshardable" allows
    # any TP/PP/VPP/DP change (docs/strategy.md). A resume loads the format it finds. megatron's
    # default `fully_sharded_model_space` needs `ShardedTensor.flattened_range`, unsupported in
    # megatron-core 0.16 without Transformer Engine.
    optimizer_sharding: Literal["dp_reshardable", "fully_reshardable"] = "dp_reshardable"
    # atomic: a crash mid-save leaves the previous checkpoint loadable
    atomic: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.atomic, bool):
            raise TypeError(f"`CheckpointConfig.atomic` must be a bool, got {self.atomic!r}.")
        if self.optimizer_sharding not in ("dp_reshardable", "fully_reshardable"):
            raise ValueError(
                "`CheckpointConfig.optimizer_sharding` must be 'dp_reshardable' or "
                f"'fully_reshardable', got {self.optimizer_sharding!r}."
            )


@dataclass(frozen=True)
class ReliabilityConfig:
    """How the run's processes talk and what stops a step: the strategy's `reliability` group.

    Attributes:
        timeout: process-group timeout of the world, all-ranks and every megatron group.
        nonfinite: `"skip"` a step whose inputs, loss or gradients are not finite, or `"raise"`.
        max_consecutive_skips: under `"skip"`, stop with an error after this many skipped steps.
        verify_updates: check every optimizer update on every rank (finite, `max_update_ratio`).
        max_update_ratio: largest update global norm / parameter global norm (`None`: no limit).
        collapse_warning_steps: warn after this many steps of exactly-0 grad norm (`None`: never).
        process_group_backend: `"nccl"`/`"gloo"` (`None`: from the device).
        intra_op_threads: torch's intra-op threads on every rank (`None`: the smallest any runs).
        rendezvous_timeout: how long start-up waits for every rank (`None`: max(timeout, 30 min)).
    """

    # Also the timeout of the all-ranks group the strategy creates for its own collectives (even
    # when the world group was created before the Trainer with another timeout) and of TP, PP,
    # DP, CP and model-parallel groups: a rank left waiting for a failed peer raises after it.
    # `None`: torch's default. See docs/reliability.md.
    timeout: timedelta | None = default_pg_timeout
    # a skipped step changes no parameter or optimizer state; counted and logged as
    # `skipped_steps`
    nonfinite: NonFinitePolicy = "skip"
    max_consecutive_skips: int = 10
    process_group_backend: str | None = None
    # set at set-up so that TP-replicated parameters round identically on every rank
    # (`lightning_mcore_rl.reliability.threads`); a rank whose count changes warns
    intra_op_threads: int | None = None
    # For torch's Adam/AdamW/SGD the update is previewed before it runs (no copy of the state)
    # and a failing one is not run; any other inner optimizer is snapshotted (one copy of the
    # parameters and optimizer state) and a failing update undone. Either way the step is
    # skipped under `nonfinite`.
    verify_updates: bool = True
    # catches an lr that overflows: 1e8 leaves finite weights whose next forward is NaN;
    # `None`: only non-finite values fail
    max_update_ratio: float | None = 1e3
    collapse_warning_steps: int | None = 5
    # the world group's store; `timeout` bounds only the collectives, so this is at least it
    rendezvous_timeout: timedelta | None = None

    def __post_init__(self) -> None:
        if self.timeout is not None:
            if not isinstance(self.timeout, timedelta):
                raise TypeError(
                    "`ReliabilityConfig.timeout` must be a datetime.timedelta or None, got "
                    f"{type(self.timeout).__name__}."
                )
            if self.timeout.total_seconds() <= 0:
                raise ValueError(
                    f"`ReliabilityConfig.timeout` must be positive, got {self.timeout}."
                )
        check_policy(self.nonfinite, self.max_consecutive_skips)
        check_update_options(
            self.verify_updates, self.max_update_ratio, self.collapse_warning_steps
        )
        self._check_rendezvous_timeout()
        backend = self.process_group_backend
        if backend is not None and not isinstance(backend, str):
            raise TypeError(
                "`ReliabilityConfig.process_group_backend` must be a str ('nccl', 'gloo') or "
                f"None, got {type(backend).__name__}."
            )
        check_intra_op_threads(self.intra_op_threads)

    @property
    def rendezvous_limit(self) -> timedelta:
        """The rendezvous timeout in force (`rendezvous_timeout` or its default)."""
        if self.rendezvous_timeout is not None:
            return self.rendezvous_timeout
        return max(self.timeout or default_pg_timeout, timedelta(minutes=30))

    def _check_rendezvous_timeout(self) -> None:
        value = self.rendezvous_timeout
        if value is None:
            return
        if not isinstance(value, timedelta):
            raise TypeError(
                "`ReliabilityConfig.rendezvous_timeout` must be a datetime.timedelta or None, "
                f"got {type(value).__name__}."
            )
        if value.total_seconds() <= 0:
            raise ValueError(
                f"`ReliabilityConfig.rendezvous_timeout` must be positive, got {value}."
            )
        if self.timeout is not None and value < self.timeout:
            raise ValueError(
                f"`ReliabilityConfig.rendezvous_timeout` ({value}) must be at least `timeout` "
                f"({self.timeout}): start-up waits for every rank, the collectives after it "
                "only for a step."
            )


@dataclass(frozen=True)
class LogprobKernelConfig:
    """How the post-processors compute logprobs: the strategy's `logprobs` group.

    Attributes:
        use_fused_linear_logprobs: logprobs from hidden x output weight in chunks (no logits).
        logprob_chunk_size: sequence chunk of the logprob / top-k kernels (`None`: unchunked).
        defer_fp32_logits: keep the last stage's logits in the model dtype (`None`: where exact).
        fused_gradient_in_forward: compute the fused head's gradients in the forward (opt-in).
    """

    # the last pipeline stage returns its final hidden states and the post-processors never
    # materialise the `[tokens, V/TP]` logits
    use_fused_linear_logprobs: bool = False
    logprob_chunk_size: int | None = None
    # in the model dtype, megatron's `Float16Module` skips its fp32 upcast of the `[tokens, V/TP]`
    # output
    # (`fp32_output=False`); the chunked kernels upcast one `logprob_chunk_size` chunk at a time
    # and write a bf16 logits gradient, so neither the fp32 logits nor their gradient exist
    # (docs/training-step.md, "Deferred fp32 logits"). `None`: on exactly where the result is
    # the fp32-logit path's (`defers_fp32_logits`): temperature 1, no top-k/top-p,
    # `logprob_chunk_size` set, and one chunked kernel reading the logits (`LOGPROB` losses
    # without an entropy bonus, `DISTILLATION` without `H_all`, logprobs, top-k, teacher
    # payloads); there losses, logprobs, top-k and parameter gradients are bitwise equal.
    # `True`: always; where two kernels read the logits the losses stay bitwise equal and the
    # gradients differ by bf16 rounding, and a temperature != 1 is divided in bf16, in place
    # (logprobs within `max|z/T| / 256`). `False`: never. Under "32-true" it changes nothing.
    defer_fp32_logits: bool | None = None
    # Needs `use_fused_linear_logprobs` and a loss that declares `token_local_gradient`
    # (`NLLLossFn`, `ClippedPGLossFn` without GSPO; no entropy, CP = 1): the backward then
    # recomputes no logits (three head GEMMs instead of four), at the cost of an fp32 `[V/TP, H]`
    # accumulator per microbatch and one weight-gradient accumulation per token chunk
    # (docs/training-step.md, "The gradient in the forward"). Faster only where the token chunk
    # is large against the machine's FLOP-to-bandwidth ratio (BENCHMARKS.md), hence opt-in.
    fused_gradient_in_forward: bool = False

    def __post_init__(self) -> None:
        fused = self.use_fused_linear_logprobs
        if not isinstance(fused, bool):
            raise TypeError(
                "`LogprobKernelConfig.use_fused_linear_logprobs` must be a bool, got "
                f"{type(fused).__name__}."
            )
        defer = self.defer_fp32_logits
        if defer is not None and not isinstance(defer, bool):
            raise TypeError(
                "`LogprobKernelConfig.defer_fp32_logits` must be a bool or None (on where "
                f"exact), got {type(defer).__name__}."
            )
        in_forward = self.fused_gradient_in_forward
        if not isinstance(in_forward, bool):
            raise TypeError(
                "`LogprobKernelConfig.fused_gradient_in_forward` must be a bool, got "
                f"{type(in_forward).__name__}."
            )
        if in_forward and not fused:
            raise ValueError(
                "`LogprobKernelConfig.fused_gradient_in_forward=True` needs "
                "`use_fused_linear_logprobs=True` (it is the fused head's backward)."
            )
        size = self.logprob_chunk_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(
                f"`LogprobKernelConfig.logprob_chunk_size` must be a positive int or None, got "
                f"{size!r}."
            )


@dataclass(frozen=True)
class MicrobatchConfig:
    """How the strategy splits each global batch: the strategy's `microbatching` group.

    Attributes:
        micro_batch_size: samples per microbatch for fixed-size microbatching.
        max_tokens_per_microbatch: token budget per microbatch (`None`: fixed-size microbatches).
        sequence_packing: pack each microbatch into one THD row (needed for CP > 1).
    """

    # validated further, with the layout, by `Microbatching`
    micro_batch_size: int = 1
    # `loss_fn` path only (needs `input_lengths`); `micro_batch_size` must stay 1, and pipeline
    # parallelism needs `sequence_packing` with a budget
    max_tokens_per_microbatch: int | None = None
    sequence_packing: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.sequence_packing, bool):
            raise TypeError(
                "`MicrobatchConfig.sequence_packing` must be a bool, got "
                f"{type(self.sequence_packing).__name__}."
            )


def _check_size(name: str, size: object) -> None:
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(
            f"`{name}` must be a positive int, got {type(size).__name__} {size!r} "
            "(a bool is not a size)."
        )
    if size < 1:
        raise ValueError(f"`{name}` must be a positive int, got {size!r}.")


@dataclass(frozen=True)
class ParallelSizes:
    """The parallel layout, validated once (the strategy's constructor builds it).

    Attributes:
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        vpp: virtual pipeline stages (model chunks) per pipeline rank, `None` without VPP.
        cp: context-parallel size.
        ep: expert-parallel size (mixture-of-experts layers: experts split over `ep` ranks).
        etp: tensor-parallel size inside each expert (`None`: `tp`, megatron's default).
        sequence_parallel: megatron sequence parallelism (needs `tp > 1`).
        sequence_packing: THD packing of each microbatch (needed for `cp > 1`).
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    etp: int | None = None
    sequence_parallel: bool = False
    sequence_packing: bool = False

    def __post_init__(self) -> None:
        for name, size in (
            ("tensor_model_parallel_size", self.tp),
            ("pipeline_model_parallel_size", self.pp),
            ("context_parallel_size", self.cp),
            ("expert_model_parallel_size", self.ep),
        ):
            _check_size(name, size)
        if self.etp is not None:
            _check_size("expert_tensor_parallel_size", self.etp)
        for name, flag in (("sequence_parallel", self.sequence_parallel),
                           ("sequence_packing", self.sequence_packing)):  # fmt: skip
            if not isinstance(flag, bool):
                raise TypeError(f"`{name}` must be a bool, got {type(flag).__name__} {flag!r}.")
        if isinstance(self.vpp, bool):
            raise TypeError(
                "`virtual_pipeline_model_parallel_size` must be None or an int >= 2, got a bool."
            )
        if self.vpp is not None and (not isinstance(self.vpp, int) or self.vpp < 2):
            raise ValueError(
                "`virtual_pipeline_model_parallel_size` must be None or an int >= 2, "
                f"got {self.vpp!r}."
            )
        if self.vpp is not None and self.pp < 2:
            raise ValueError(
                f"`virtual_pipeline_model_parallel_size={self.vpp}` needs "
                f"`pipeline_model_parallel_size` >= 2, got {self.pp}."
            )
        if self.sequence_parallel and self.tp < 2:
            raise ValueError(
                "`sequence_parallel=True` needs `tensor_model_parallel_size` >= 2, "
                f"got {self.tp}; set `sequence_parallel=False`."
            )
        if self.cp > 1 and not self.sequence_packing:
            raise ValueError(
                f"`context_parallel_size={self.cp}` needs `sequence_packing=True` "
                "(context parallelism shards packed THD sequences)."
            )
        if self.ep == 1 and self.expert_tp != self.tp:
            # megatron-core 0.16 reduces expert gradients over the expert data-parallel group
            # only for EP > 1; at EP=1 they take the dense DP group, which misses the ranks
            # the expert TP split adds (expert gradients measurably off at TP=2, ETP=1).
            raise ValueError(
                f"`expert_tensor_parallel_size={self.etp}` differs from "
                f"`tensor_model_parallel_size={self.tp}`, which needs "
                "`expert_model_parallel_size` > 1, got 1; leave `expert_tensor_parallel_size` "
                "unset or raise the expert-parallel size."
            )

    @property
    def expert_tp(self) -> int:
        """The tensor-parallel size inside each expert (`etp`, default `tp`)."""
        return self.tp if self.etp is None else self.etp

    def transformer_config_kwargs(self, bf16: bool, dtype: Any) -> dict[str, Any]:
        """The `TransformerConfig` fields this layout and a precision own."""
        from lightning_mcore_rl.megatron_defaults import pipeline_p2p_settings

        layout = self.hparams()
        del layout["sequence_packing"]  # a property of the batches, not of the model
        return {
            **layout,
            "expert_tensor_parallel_size": self.expert_tp,
            "bf16": bf16,
            "params_dtype": dtype,
            "pipeline_dtype": dtype,
            **pipeline_p2p_settings(self.vpp),
        }

    def hparams(self) -> dict[str, Any]:
        """The layout under the strategy's argument names (logged as hyperparameters)."""
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp,
            "context_parallel_size": self.cp,
            "expert_model_parallel_size": self.ep,
            "expert_tensor_parallel_size": self.etp,
            "sequence_parallel": self.sequence_parallel,
            "sequence_packing": self.sequence_packing,
        }

    def check_backend(self, backend: str, device_type: str) -> None:
        """Refuse a layout the process-group `backend` cannot run on `device_type` tensors.

        Raises:
            ValueError: EP > 1 with expert TP > 1 on gloo (CPU), naming the sizes and the
                layouts that run (`check_expert_collectives`).
        """
        # called in `setup_environment`, before the process group exists
        from lightning_mcore_rl.models.layout import check_expert_collectives

        check_expert_collectives(
            self.tp, self.ep, self.expert_tp, backend, device_type, "MCoreRLStrategy"
        )

    @property
    def model_parallel_size(self) -> int:
        """`tp * pp * cp`: ranks holding one replica of the model."""
        return self.tp * self.pp * self.cp

    def check_world_size(self, world_size: int) -> int:
        """The data-parallel size for `world_size` ranks.

        Raises:
            ValueError: `tp * pp * cp` or `etp * ep * pp` does not divide `world_size`.
        """
        # the dense layers' replica
        if world_size % self.model_parallel_size != 0:
            raise ValueError(
                f"The sizes tp={self.tp}, pp={self.pp}, cp={self.cp} multiplied "
                f"({self.model_parallel_size}) should divide the world size {world_size}; "
                "change the parallel sizes or `Trainer(devices=..., num_nodes=...)`."
            )
        # the expert layers' replica (megatron's expert layout)
        expert = self.expert_tp * self.ep * self.pp
        if world_size % expert != 0:
            raise ValueError(
                f"The expert sizes expert_tensor_parallel_size={self.expert_tp}, "
                f"expert_model_parallel_size={self.ep}, pp={self.pp} multiplied ({expert}) "
                f"should divide the world size {world_size}; change them or "
                "`Trainer(devices=..., num_nodes=...)`."
            )
        return world_size // self.model_parallel_size


FLAT_ARGUMENTS: dict[str, str] = {
    "micro_batch_size": "microbatching",
    "max_tokens_per_microbatch": "microbatching",
    "sequence_packing": "microbatching",
    "use_distributed_optimizer": "ddp",
    "timeout": "reliability",
    "nonfinite": "reliability",
    "max_consecutive_skips": "reliability",
    "process_group_backend": "reliability",
    "use_fused_linear_logprobs": "logprobs",
    "logprob_chunk_size": "logprobs",
}
"""Deprecated flat keyword arguments (Python only; a `FutureWarning`) -> the group whose field of
the same name they set (`MCoreRLStrategy(use_fused_linear_logprobs=True)` is
`MCoreRLStrategy(logprobs=LogprobKernelConfig(use_fused_linear_logprobs=True))`)."""

_GROUPS: dict[str, type] = {
    "microbatching": MicrobatchConfig,
    "ddp": MegatronDDPConfig,
    "reliability": ReliabilityConfig,
    "logprobs": LogprobKernelConfig,
}

_F = TypeVar("_F", bound=Callable[..., None])


def flat_argument_warning(flat: dict[str, Any]) -> str:
    """The `FutureWarning` text for the deprecated flat arguments `flat` (name -> value): each
    one's grouped equivalent, e.g. `micro_batch_size=4 -> microbatching=MicrobatchConfig(...)`."""
    spelled = "; ".join(
        f"{name}={value!r} -> {FLAT_ARGUMENTS[name]}="
        f"{_GROUPS[FLAT_ARGUMENTS[name]].__name__}({name}={value!r})"
        for name, value in flat.items()
    )
    return (
        "MCoreRLStrategy's flat arguments are deprecated and will be removed; pass their "
        f"groups instead (one config per group): {spelled}."
    )


def accept_flat_arguments(init: _F) -> _F:
    """Wrap `MCoreRLStrategy.__init__` so the deprecated flat names of `FLAT_ARGUMENTS` still work.

    Raises:
        TypeError: a flat name together with its group passed explicitly, or
            `cluster_environment`.
    """
    # Each flat name is folded into its group (built with that group's defaults for the other
    # fields), with one `FutureWarning` per construction naming the grouped spelling. The
    # signature seen by `inspect` and LightningCLI stays the grouped one (YAML nests them:
    # `reliability: {timeout: ...}`).

    @functools.wraps(init)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
        # Lightning takes a cluster environment as `Trainer(plugins=[...])`
        if "cluster_environment" in kwargs:
            raise TypeError(
                "MCoreRLStrategy takes no `cluster_environment`: pass it to the Trainer as "
                "`Trainer(plugins=[<the ClusterEnvironment>])`."
            )
        flat = {name: kwargs.pop(name) for name in list(kwargs) if name in FLAT_ARGUMENTS}
        if flat:
            # stacklevel 2: the warning points at the caller's `MCoreRLStrategy(...)` line
            warnings.warn(flat_argument_warning(flat), FutureWarning, stacklevel=2)
        bound = inspect.signature(init).bind_partial(self, *args, **kwargs).arguments
        for group, config in _GROUPS.items():
            fields = {n: v for n, v in flat.items() if FLAT_ARGUMENTS[n] == group}
            if not fields:
                continue
            # which of the two wins would be a guess
            if bound.get(group) is not None:
                raise TypeError(
                    f"MCoreRLStrategy got both `{group}=` and "
                    f"{', '.join(f'`{n}=`' for n in fields)}; set "
                    f"{', '.join(f'`{n}`' for n in fields)} inside `{group}` "
                    f"({config.__name__}) instead."
                )
            bound[group] = config(**fields)
        init(**bound)

    return cast(_F, wrapper)
