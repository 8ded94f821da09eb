"""Trainer-free mechanics of one megatron step: wrap model chunks, run the schedule over a list
of microbatches, make the step's metrics identical on every rank.

The strategy calls these; nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

ForwardStepFunc = Callable[[Any, torch.nn.Module], tuple[torch.Tensor, Callable[..., Any]]]


@dataclass(frozen=True)
class StepOutput:
    """Result of one forward(-backward) over a global batch, identical on every rank.

    Attributes:
        loss: scalar fp32 loss: mean of the microbatch losses over this step, broadcast from the
            last pipeline stage and averaged over data-parallel ranks.
        metrics: other scalar metrics, reduced the same way.
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
            chunk.config.finalize_model_grads_func = finalize_model_grads
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
) -> StepOutput:
    """Make a step's metrics identical on every rank.

    The last pipeline stage reduces each metric over its microbatches; the values are broadcast
    over the pipeline group (one object broadcast, so other stages learn the metric names too) and
    reduced over the data-parallel group in fp64. TP/CP ranks of a replica already agree.

    Args:
        outputs: the schedule's per-microbatch metric dicts (last stage; ``[]`` elsewhere).
        device: where the collective's tensor lives (the CUDA device under NCCL).
        reduction: ``"mean"`` over microbatches and DP ranks (a per-microbatch mean loss), or
            ``"sum"`` over both (losses already normalised by GLOBAL valid counts, whose parts
            add up to the global-batch loss).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    local: dict[str, Any] | None = None
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        keys = list(outputs[0]) if outputs else []
        local = {
            "means": {k: _reduce([o[k] for o in outputs], reduction) for k in keys},
            "losses": tuple(float(o["loss"]) for o in outputs if "loss" in o),
        }
    if ps.get_pipeline_model_parallel_world_size() > 1:
        holder = [local]
        dist.broadcast_object_list(
            holder,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
        local = holder[0]
    assert local is not None
    names = sorted(local["means"])
    values = torch.tensor([local["means"][k] for k in names], dtype=torch.float64, device=device)
    dp_size = ps.get_data_parallel_world_size()
    if dp_size > 1 and names:
        dist.all_reduce(values, group=ps.get_data_parallel_group())
        if reduction == "mean":
            values /= dp_size
    reduced = {k: values[i].float().cpu() for i, k in enumerate(names)}
    loss = reduced.pop("loss", torch.tensor(float("nan")))
    return StepOutput(loss=loss, metrics=reduced, microbatch_losses=local["losses"])


def _reduce(values: Sequence[Any], reduction: str) -> float:
    stacked = torch.stack([torch.as_tensor(v).detach().float().reshape(()) for v in values])
    return float(stacked.mean() if reduction == "mean" else stacked.sum())
