"""Trainer-free mechanics of one megatron step: wrap model chunks, run the schedule over a list
of microbatches, make the step's metrics identical on every rank.

The strategy calls these; nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

import torch

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

ForwardStepFunc = Callable[[Any, torch.nn.Module], tuple[torch.Tensor, Callable[..., Any]]]


@dataclass(frozen=True)
class StepOutput:
    """Result of one forward(-backward) over a global batch, identical on every rank.

    Attributes:
        loss: scalar fp32 loss: mean of the microbatch losses over this step, broadcast from the
            last pipeline stage and averaged over data-parallel ranks.
        metrics: other scalar metrics, reduced the same way (``loss_fn`` path: each by its
            ``MetricNormalizer``, equal to the metric of the whole global batch).
        microbatch_losses: this DP rank's per-microbatch losses (last PP stage; broadcast to the
            other stages), for exact comparisons.
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    microbatch_losses: tuple[float, ...] = ()


def unwrap_model(chunk: torch.nn.Module) -> torch.nn.Module:
    """The megatron model inside DDP / ``Float16Module`` wrappers."""
    while hasattr(chunk, "module") and isinstance(chunk.module, torch.nn.Module):
        chunk = chunk.module
    return chunk


def wrap_chunks(
    chunks: Sequence[torch.nn.Module], *, bf16: bool, ddp_config: Any | None
) -> list[torch.nn.Module]:
    """``Float16Module`` (bf16) and megatron ``DistributedDataParallel`` (when ``ddp_config`` is
    given, i.e. when training) around each chunk, and ``finalize_model_grads`` on the config —
    without it megatron does NO data-parallel gradient reduction."""
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


def lm_forward_step(data_iterator: Any, model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
    """Megatron ``forward_step_func`` for a plain LM loss on ``{"tokens", "labels"}`` ``[b, S]``
    microbatches (the microbatch loss is the mean per-token cross entropy)."""
    batch = next(data_iterator)
    tokens = batch["tokens"]
    position_ids = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    per_token_loss = model(tokens, position_ids, None, labels=batch["labels"])  # [b, S]

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = output.float().mean()
        # clone: the schedule divides the returned loss in place by num_microbatches.
        return loss, {"loss": loss.detach().clone()}

    return per_token_loss, loss_func


def run_schedule(
    chunks: Sequence[torch.nn.Module],
    microbatches: Sequence[Any],
    forward_step_func: ForwardStepFunc,
    *,
    seq_length: int,
    micro_batch_size: int,
    forward_only: bool,
) -> list[dict[str, Any]]:
    """Megatron's forward-backward schedule (no-pipelining, 1F1B or interleaved, chosen from the
    parallel state) over ``microbatches``; each model chunk gets its own iterator over the same
    microbatches. Gradients land in the DDP buffers, already finalised (DP-reduced).

    Returns:
        The loss functions' metric dicts, one per microbatch, on the last pipeline stage; ``[]``
        elsewhere.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    iterators: list[Any] = [iter(microbatches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step_func,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=list(chunks) if len(chunks) > 1 else chunks[0],
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def reduce_step_outputs(
    outputs: Sequence[dict[str, Any]],
    *,
    device: torch.device | str = "cpu",
    reduction: Literal["mean", "sum"] = "mean",
    normalizations: Mapping[str, Any] | None = None,
    source: str = "the loss function",
) -> StepOutput:
    """Make a step's metrics identical on every rank.

    The last pipeline stage combines each metric over its microbatches (one host transfer); the
    values are broadcast over the pipeline group (one object broadcast, so other stages learn the
    metric names too) and reduced over the data-parallel group in fp64 with ONE all-reduce per
    reduction kind (sum; min and max only when such metrics exist). TP/CP ranks of a replica
    already agree.

    Args:
        outputs: the schedule's per-microbatch metric dicts (last stage; ``[]`` elsewhere).
        device: where the collectives' tensors live (the CUDA device under NCCL).
        reduction: without ``normalizations``: ``"mean"`` over microbatches and DP ranks (a
            per-microbatch mean loss), or ``"sum"`` over both (losses already normalised by
            GLOBAL valid counts, whose parts add up to the global-batch loss).
        normalizations: a loss's ``metric_normalizations`` (``MetricNormalizer`` per metric);
            overrides ``reduction``: ``TOKENS``/``SEQUENCES``/``NONE`` metrics are summed over
            microbatches and DP ranks, ``MIN``/``MAX`` combined with min/max (``±inf`` when
            empty), so the result equals the metrics of the whole global batch at once. A
            metric missing on some DP ranks is reduced over the ranks that have it.
        source: names the loss in the error for an undeclared metric.

    Raises:
        ValueError: (on every rank) a metric has no entry in ``normalizations``.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from lightning_mcore_rl.losses.interfaces import MetricNormalizer, combine_microbatch_metrics

    local: dict[str, Any] | None = None
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        host = _to_host(outputs, device)
        error = None
        if normalizations is None:
            values = {k: _reduce([o[k] for o in host], reduction) for k in (host[:1] or [{}])[0]}
        else:
            undeclared = sorted({k for o in host for k in o} - set(normalizations))
            if undeclared:
                error = (
                    f"{source} returned metric(s) {undeclared} without an entry in its "
                    f"`metric_normalizations` (declared: {sorted(normalizations)}); declare a "
                    "`MetricNormalizer` for each so it is reduced exactly over microbatches "
                    "and data-parallel ranks."
                )
            values = {} if error else combine_microbatch_metrics(host, normalizations)
        losses = tuple(o["loss"] for o in host if "loss" in o)
        local = {"values": values, "losses": losses, "error": error}
    if ps.get_pipeline_model_parallel_world_size() > 1:
        holder = [local]
        dist.broadcast_object_list(
            holder,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
        local = holder[0]
    assert local is not None
    values = local["values"]
    if normalizations is None:
        kinds = dict.fromkeys(sorted(values), "sum")
    else:
        combine = {MetricNormalizer.MIN: "min", MetricNormalizer.MAX: "max"}
        kinds = {k: combine.get(MetricNormalizer(how), "sum") for k, how in normalizations.items()}
    reduced = _all_reduce_by_kind(values, kinds, local["error"] is not None, device)
    if reduced is None:
        raise ValueError(
            local["error"]
            or f"{source} returned an undeclared metric on another data-parallel rank "
            "(see that rank's error)."
        )
    if normalizations is None and reduction == "mean":
        dp_size = ps.get_data_parallel_world_size()
        reduced = {k: v / dp_size for k, v in reduced.items()}
    metrics = {k: v.float() for k, v in reduced.items()}
    loss = metrics.pop("loss", torch.tensor(float("nan")))
    return StepOutput(loss=loss, metrics=metrics, microbatch_losses=local["losses"])


def _all_reduce_by_kind(
    values: Mapping[str, float], kinds: Mapping[str, str], failed: bool, device: Any
) -> dict[str, torch.Tensor] | None:
    """Reduce ``values`` over DP: ONE fp64 all-reduce per kind (``sum``/``min``/``max``).

    The sum tensor also carries how many ranks hold each metric (a metric held by none is
    dropped) and an error flag (``None`` on every rank when any rank ``failed``).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    identity = {"sum": 0.0, "min": float("inf"), "max": float("-inf")}
    names = {kind: sorted(k for k, v in kinds.items() if v == kind) for kind in identity}
    packed = {kind: [values.get(k, identity[kind]) for k in keys] for kind, keys in names.items()}
    packed["sum"] += [float(k in values) for k in sorted(kinds)] + [float(failed)]
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    tensors = {
        kind: torch.tensor(v, dtype=torch.float64, device=device) for kind, v in packed.items()
    }
    if ps.get_data_parallel_world_size() > 1:
        for kind, tensor in tensors.items():
            if tensor.numel():
                dist.all_reduce(tensor, op=ops[kind], group=ps.get_data_parallel_group())
    tensors = {kind: tensor.cpu() for kind, tensor in tensors.items()}  # <= 3 host transfers
    held = tensors["sum"][len(names["sum"]) :].tolist()
    if held[-1] > 0:
        return None
    holders = dict(zip(sorted(kinds), held[:-1], strict=True))
    return {
        k: tensors[kind][i]
        for kind, keys in names.items()
        for i, k in enumerate(keys)
        if holders[k] > 0
    }


def _to_host(outputs: Sequence[dict[str, Any]], device: Any) -> list[dict[str, float]]:
    """Scalar metrics -> Python floats (exact, via fp64) with ONE device-to-host transfer."""
    flat = [
        torch.as_tensor(v, device=device).detach().reshape(()).double()
        for o in outputs
        for v in o.values()
    ]
    host = iter(torch.stack(flat).cpu().tolist() if flat else [])
    return [{k: next(host) for k in o} for o in outputs]


def _reduce(values: Sequence[float], reduction: str) -> float:
    stacked = torch.tensor(values, dtype=torch.float32)
    return float(stacked.mean() if reduction == "mean" else stacked.sum())
