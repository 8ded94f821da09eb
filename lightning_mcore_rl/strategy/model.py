"""Trainer-free wrapping of megatron model chunks (``Float16Module``, megatron DDP)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig


_MEGATRON_CP_ASSERT = "Context parallelism is only supported by TEDotProductAttention"
_MEGATRON_MOE_ASSERT = "when instantiating MoELayer"
_MEGATRON_MOE_BIAS_ASSERT = "Bias in Moe is only supported when ETP==1"


def build_stage_chunks(
    build: Callable[[int | None], Any], vp_stages: Sequence[int | None], hook: str
) -> list[Any]:
    """`build(vp_stage)` for every stage of this rank (the module's `hook`).

    Raises:
        ValueError: for megatron's bare `AssertionError`s: local-spec attention under CP, experts
            not split over the EP ranks, MoE biases under expert TP > 1."""
    try:
        return [build(vp_stage) for vp_stage in vp_stages]
    except AssertionError as err:
        if _MEGATRON_MOE_BIAS_ASSERT in str(err):  # TransformerConfig's __post_init__
            raise ValueError(
                f"`{hook}`: megatron refused the config ({err}): MoE layers with biases "
                "(`TransformerConfig.add_bias_linear=True`, megatron's default) need an expert "
                "tensor-parallel size of 1, which defaults to the TP size; build the config "
                "with `add_bias_linear=False`, or set "
                "`MCoreRLStrategy(expert_tensor_parallel_size=1)` with "
                "`expert_model_parallel_size` > 1."
            ) from err
        if _MEGATRON_MOE_ASSERT in str(err):
            raise ValueError(
                f"`{hook}`: megatron's MoELayer refused the config ({err}); "
                "`TransformerConfig.num_moe_experts` must be divisible by "
                "`MCoreRLStrategy(expert_model_parallel_size=...)` (each EP rank holds E/EP "
                "experts)."
            ) from err
        if _MEGATRON_CP_ASSERT not in str(err):
            raise
        raise ValueError(
            f"`{hook}`: context_parallel_size > 1 needs a CP-capable core attention; build the "
            "model with `transformer_layer_spec=lightning_mcore_rl.models.layers."
            "get_packed_local_layer_spec()` (local spec, CPU) or Transformer Engine's GPT layer "
            "spec (megatron's local DotProductAttention has no context parallelism)."
        ) from err


def wrap_chunks(
    chunks: Sequence[torch.nn.Module], *, bf16: bool, ddp_config: Any | None
) -> list[torch.nn.Module]:
    """`Float16Module` (bf16) and megatron `DistributedDataParallel` (with `ddp_config`: when
    training) around each chunk, and `finalize_model_grads` on the config."""
    # without `finalize_model_grads` megatron does NO data-parallel gradient reduction
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    wrapped: list[torch.nn.Module] = []
    for chunk in chunks:
        config = chunk.config
        module = Float16Module(config, chunk) if bf16 else chunk
        if ddp_config is not None:
            if any(hasattr(p, "main_grad") for p in chunk.parameters()):
                raise RuntimeError(
                    "The model chunks are already wrapped in megatron DDP by another Trainer; "
                    "build a new LightningModule for each Trainer.fit."
                )
            module = DistributedDataParallel(config, ddp_config, module)
        wrapped.append(module)
    if ddp_config is not None:
        for chunk in chunks:
            cast("TransformerConfig", chunk.config).finalize_model_grads_func = finalize_model_grads
    return wrapped


class WrappedChunks:
    """The wrapped chunks megatron's schedule runs, re-wrapped only when the module's raw chunks
    change or a `fit` needs megatron DDP around chunks an evaluation wrapped without it."""

    def __init__(self) -> None:
        self.wrapped: list[torch.nn.Module] = []
        self._raw: list[torch.nn.Module] = []

    def update(
        self, raw: Sequence[torch.nn.Module], *, bf16: bool, ddp_config: Any | None
    ) -> list[torch.nn.Module]:
        """The wrapped chunks for ``raw`` (see `wrap_chunks`)."""
        needs_ddp = ddp_config is not None and not any(
            hasattr(c, "zero_grad_buffer") for c in self.wrapped
        )
        if self._raw != list(raw) or needs_ddp:
            self.wrapped = wrap_chunks(raw, bf16=bf16, ddp_config=ddp_config)
            self._raw = list(raw)
        return self.wrapped


def checked_chunks(
    module: Any, vp_stages: Sequence[int | None], expected: Mapping[str, Any]
) -> list[torch.nn.Module]:
    """The module's raw chunks, one per VPP stage, each config holding the `expected` fields.

    Raises:
        TypeError: no ``chunks`` or a chunk without a megatron ``config``.
        ValueError: the wrong number of chunks, or a config field that disagrees."""
    chunks = getattr(module, "chunks", None)
    if chunks is None:
        raise TypeError(
            f"MCoreRLStrategy needs a LightningModule with megatron model chunks in "
            f"`self.chunks` (subclass `MCoreRLModule`); {type(module).__name__} has none "
            "after `configure_model`."
        )
    check_chunk_layout(list(chunks), vp_stages, expected, what="model chunk", hook="build_chunk")
    return list(chunks)


def check_chunk_layout(
    chunks: Sequence[torch.nn.Module],
    vp_stages: Sequence[int | None],
    expected: Mapping[str, Any],
    *,
    what: str,
    hook: str,
) -> None:
    """One chunk per VPP stage, each with a megatron config holding the `expected` fields
    (`what`, `hook`: the chunks' name and the module hook that built them, for the messages).

    Raises:
        TypeError: a chunk without a megatron ``config``.
        ValueError: the wrong number of chunks, or a config field that disagrees."""
    if len(chunks) != len(vp_stages):
        raise ValueError(
            f"The module built {len(chunks)} {what}(s) but the strategy runs "
            f"{len(vp_stages)} (one per virtual pipeline stage); build one chunk per entry of "
            f"`strategy.vp_stages` in `{hook}(vp_stage)`."
        )
    name = what[0].upper() + what[1:]
    for index, chunk in enumerate(chunks):
        config = getattr(chunk, "config", None)
        if config is None:
            raise TypeError(f"{name} {index} ({type(chunk).__name__}) has no megatron config.")
        _check_moe_layout(config, f"{name} {index}")
        for key, value in expected.items():
            actual = getattr(config, key)
            if actual != value:
                raise ValueError(
                    f"{name} {index}: `TransformerConfig.{key}={actual!r}` but the strategy "
                    f"and Trainer set {value!r}; build the config with "
                    "`strategy.transformer_config_kwargs()` (see `MCoreRLModule.transformer_config`)."
                )


def _check_moe_layout(config: Any, what: str) -> None:
    """What megatron's MoE layers need of the layout, checked at setup: experts divisible by EP,
    sequence parallelism under TP > 1, a token dispatcher taking per-rank token counts, no
    router recompute.

    Raises:
        ValueError: naming the field and the fix."""
    # at setup: megatron only warns at build time and raises in the first training forward
    # (mid-step); router recompute would count each router call twice in the router statistics
    experts = getattr(config, "num_moe_experts", None)
    if not experts:
        return
    ep = config.expert_model_parallel_size
    if experts % ep:
        raise ValueError(
            f"{what}: `TransformerConfig.num_moe_experts={experts}` is not divisible by "
            f"`expert_model_parallel_size={ep}`; each EP rank holds E/EP experts."
        )
    if config.tensor_model_parallel_size > 1 and not config.sequence_parallel:
        raise ValueError(
            f"{what}: MoE layers with `tensor_model_parallel_size="
            f"{config.tensor_model_parallel_size}` need `sequence_parallel=True` (megatron's "
            "MoELayer refuses to train without it); set "
            "`MCoreRLStrategy(sequence_parallel=True)`."
        )
    dispatcher = config.moe_token_dispatcher_type
    if dispatcher == "allgather" and ep * config.expert_tensor_parallel_size > 1:
        # measured: packed rows of 21 and 16 tokens on two EP ranks fail in the all-gather
        raise ValueError(
            f"{what}: `TransformerConfig.moe_token_dispatcher_type='allgather'` gathers equal "
            f"token counts over the {ep} x {config.expert_tensor_parallel_size} expert ranks, "
            "but this strategy's microbatches hold different numbers of tokens per rank "
            "(packing, per-microbatch padding); set `moe_token_dispatcher_type='alltoall'`."
        )
    recompute = config.recompute_granularity
    if recompute == "full" or (recompute == "selective" and "moe" in config.recompute_modules):
        raise ValueError(
            f"{what}: `TransformerConfig.recompute_granularity={recompute!r}` recomputes the "
            "MoE routers in the backward pass, which the router statistics would count twice; "
            "recompute only other modules (e.g. `recompute_modules=['core_attn', 'moe_act']`)."
        )
