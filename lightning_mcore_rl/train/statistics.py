"""Training statistics across microbatches, pipeline stages and data-parallel ranks (§2.9)."""

# docs/behaviour-reference.md §2.9: the seed's `aggregate_training_statistics` and the step's
# `reduce_step_statistics`, which follows the rule table of `losses.REDUCTION_RULES`.

from __future__ import annotations

import math
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

from lightning_mcore_rl.losses import (
    MEAN_RULE,
    REDUCTION_RULES,
    MetricNormalizer,
    ReductionRule,
    combine_microbatch_metrics,
)
from lightning_mcore_rl.metrics import combine_rows
from lightning_mcore_rl.metrics.reduction import Combine
from lightning_mcore_rl.parallel import ParallelGroups


def _materialise(all_mb_metrics: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Scalar tensor metrics -> Python floats with ONE host transfer; other values unchanged."""
    scalars = [
        (i, key, value.detach().reshape(()).float())
        for i, metrics in enumerate(all_mb_metrics)
        for key, value in metrics.items()
        if isinstance(value, torch.Tensor) and value.numel() == 1
    ]
    out = [dict(metrics) for metrics in all_mb_metrics]
    if scalars:
        host = torch.stack([value.cpu() for _, _, value in scalars]).tolist()
        for (i, key, _), value in zip(scalars, host, strict=True):
            out[i][key] = value
    return out


def aggregate_training_statistics(
    all_mb_metrics: list[dict[str, Any]],
    losses: list[float | torch.Tensor],
    data_parallel_group: Any,
) -> tuple[dict[str, list[Any]], torch.Tensor]:
    """The per-buffer `losses` summed over DP (one all-reduce) and the metrics listed per
    microbatch -> `(mb_metrics, global_loss)`: `{name: values in microbatch order}` (scalar
    tensors as floats) and the `[len(losses)]` fp32 losses."""
    # CP ranks hold identical losses: the reduction is over DP only (behaviour-reference trap 4)
    with torch.no_grad():
        values = [torch.as_tensor(loss).detach().reshape(()).float() for loss in losses]
        device = values[0].device if values else torch.device("cpu")
        global_loss = torch.stack(values) if values else torch.zeros(0, device=device)
        dist.all_reduce(global_loss, op=dist.ReduceOp.SUM, group=data_parallel_group)
    mb_metrics: dict[str, list[Any]] = {}
    for metrics in _materialise(all_mb_metrics):
        for key, value in metrics.items():
            mb_metrics.setdefault(key, []).append(value)
    return mb_metrics, global_loss


@dataclass(frozen=True)
class StepOutput:
    """One global batch's statistics, identical on every rank.

    Attributes:
        loss: scalar fp32 loss of the whole global batch.
        metrics: the loss's other metrics, each combined by its `MetricNormalizer` rule.
        microbatch_losses: this DP replica's per-microbatch losses (for exact comparisons).
        samples: samples in the global batch (all DP ranks).
        tokens: real tokens in the global batch, counted once per DP replica.
        response_length_mean: mean `token_mask` tokens per valid sample (`nan` without one).
        response_length_max: the longest such response (`nan` without a `token_mask`).
    """

    # `loss_fn` path: the sum of the globally normalised microbatch losses over microbatches
    # and DP ranks; LM path: the mean of the per-microbatch mean losses
    loss: torch.Tensor
    # each the value of the whole batch (`losses.REDUCTION_RULES`)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    microbatch_losses: tuple[float, ...] = ()
    samples: float = 0.0
    # `input_lengths` when given, else the width of every row
    tokens: float = 0.0
    response_length_mean: float = float("nan")
    response_length_max: float = float("nan")

    def as_step_result(self) -> dict[str, Any]:
        """`{"loss": loss, STEP_OUTPUT_KEY: self}`: what a Lightning `training_step` /
        `validation_step` returns."""
        # so the statistics reach the callbacks' `on_train_batch_end` /
        # `on_validation_batch_end` as data
        return {"loss": self.loss, STEP_OUTPUT_KEY: self}


STEP_OUTPUT_KEY = "step_output"
"""The key of the :class:`StepOutput` in a step's Lightning result (:meth:`StepOutput.as_step_result`)."""


def batch_counts(batch: Mapping[str, Any]) -> dict[str, float]:
    """This DP rank's sample/token/response-length counts, on the host (no collective)."""
    # `samples`, `tokens`, `response_tokens` and `responses` are sums (reduced over DP by
    # summing); `response_length_max` is reduced by max (`-inf` without a `token_mask`)
    ids = batch.get("input_ids", batch.get("tokens"))
    if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
        return {"samples": 0.0, "tokens": 0.0, "response_tokens": 0.0, "responses": 0.0,
                "response_length_max": float("-inf")}  # fmt: skip
    lengths = batch.get("input_lengths")
    tokens = float(lengths.sum()) if isinstance(lengths, torch.Tensor) else float(ids.numel())
    counts = {"samples": float(ids.shape[0]), "tokens": tokens}
    token_mask = batch.get("token_mask")
    if isinstance(token_mask, torch.Tensor):
        sample_mask = batch.get("sample_mask")
        valid = (
            sample_mask.bool()
            if isinstance(sample_mask, torch.Tensor)
            else torch.ones(ids.shape[0], dtype=torch.bool)
        )
        per_sample = token_mask.float().sum(-1)[valid]
        counts["response_tokens"] = float(per_sample.sum())
        counts["responses"] = float(per_sample.numel())
        counts["response_length_max"] = float(per_sample.max()) if per_sample.numel() else 0.0
    else:
        counts.update(responses=0.0, response_tokens=0.0, response_length_max=float("-inf"))
    return counts


def reduce_step_statistics(
    outputs: Sequence[Mapping[str, Any]],
    counts: Mapping[str, float],
    groups: ParallelGroups,
    *,
    normalizations: Mapping[str, MetricNormalizer] | None,
    source: str,
    device: torch.device | str = "cpu",
) -> StepOutput:
    """One global batch's loss, metrics and counts, identical on every rank.

    Args:
        outputs: the schedule's per-microbatch metric dicts with a `loss` (last stage; `[]` else).
        normalizations: the loss's `metric_normalizations`; `None` (LM path): all averaged.
        source: names the loss in the error for an undeclared metric.

    Raises:
        ValueError: (on every rank) a metric has no entry in `normalizations`.
    """
    # one fp64 all-gather over DP on the last stage (none at DP=1), one broadcast over PP
    # the gathered vector: every metric combined over microbatches (then over DP by its rule in
    # losses.REDUCTION_RULES), the batch counts and the per-microbatch losses (summed over DP:
    # what the seed's aggregate_training_statistics all-reduce gives, without a second
    # collective); TP/CP ranks agree already
    payload: dict[str, Any] | None = None
    if groups.is_pipeline_last_stage:
        payload = _reduce_on_last_stage(outputs, counts, groups, normalizations, source, device)
    if groups.pp_size > 1:
        payload = _broadcast_payload(payload, groups, device)
    assert payload is not None  # the last stage always fills it
    if payload["error"] is not None:
        raise ValueError(payload["error"])
    summed = payload["counts"]
    responses = summed["responses"]
    return StepOutput(
        loss=torch.tensor(payload["loss"], dtype=torch.float32),
        metrics={k: torch.tensor(v, dtype=torch.float32) for k, v in payload["metrics"].items()},
        microbatch_losses=tuple(payload["microbatch_losses"]),
        samples=summed["samples"],
        tokens=summed["tokens"],
        response_length_mean=summed["response_tokens"] / responses if responses else math.nan,
        response_length_max=summed["response_length_max"] if responses else math.nan,
    )


def _reduce_on_last_stage(
    outputs: Sequence[Mapping[str, Any]],
    counts: Mapping[str, float],
    groups: ParallelGroups,
    normalizations: Mapping[str, MetricNormalizer] | None,
    source: str,
    device: torch.device | str,
) -> dict[str, Any]:
    """The last stage's part of `reduce_step_statistics`: its one DP collective is the
    rule vector's all-gather, the per-microbatch losses riding in it."""
    host = _materialise([dict(o) for o in outputs])
    local_losses = [float(o["loss"]) for o in host]
    metrics_only = [{k: v for k, v in o.items() if k != "loss"} for o in host]
    error = None
    rules: dict[str, ReductionRule]
    if normalizations is None:
        keys = sorted({k for o in metrics_only for k in o})
        rules = dict.fromkeys(keys, MEAN_RULE)
        local = {k: sum(o[k] for o in metrics_only if k in o) for k in keys}
    else:
        undeclared = sorted({k for o in metrics_only for k in o} - set(normalizations))
        if undeclared:
            error = (
                f"{source} returned metric(s) {undeclared} without an entry in its "
                f"`metric_normalizations` (declared: {sorted(normalizations)}); declare a "
                "`MetricNormalizer` for each so it is reduced exactly over microbatches and "
                "data-parallel ranks."
            )
        rules = {k: REDUCTION_RULES[MetricNormalizer(v)] for k, v in normalizations.items()}
        rules.pop("loss", None)
        local = {} if error else combine_microbatch_metrics(metrics_only, normalizations)
    reduced = _reduce_over_dp(local, rules, counts, local_losses, error is not None, groups, device)
    if reduced is None:
        error = error or (
            f"{source} returned an undeclared metric on another data-parallel rank (see that "
            "rank's error)."
        )
        return {"error": error}
    metrics, summed, summed_losses = reduced
    loss = math.fsum(summed_losses)
    if normalizations is None:  # per-microbatch means: average over microbatches and DP
        denominator = max(len(host), 1) * groups.dp_size
        loss /= denominator
        metrics = {k: v / denominator for k, v in metrics.items()}
    return {
        "error": None,
        "loss": loss,
        "metrics": metrics,
        "microbatch_losses": local_losses,
        "counts": summed,
    }


_PAYLOAD_BYTES = 1 << 14
"""Size of the pipeline broadcast's buffer: a step's pickled statistics fit (tens of bytes
per metric); a larger payload costs a second broadcast."""


def _broadcast_payload(
    payload: dict[str, Any] | None, groups: ParallelGroups, device: torch.device | str
) -> dict[str, Any]:
    """The last stage's pickled `payload` to every stage of the pipeline in ONE broadcast."""
    # a 16 KiB buffer (`[length: 8 bytes][pickle]`; the rest, if any, in a second one), where
    # `broadcast_object_list` always needs two (sizes, then data)
    buffer = torch.zeros(_PAYLOAD_BYTES, dtype=torch.uint8)
    blob = b""
    if groups.is_pipeline_last_stage:
        data = pickle.dumps(payload)
        blob = len(data).to_bytes(8, "little") + data
        head = blob[:_PAYLOAD_BYTES]
        buffer[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    buffer = buffer.to(device)
    dist.broadcast(buffer, src=groups.pp_last_rank, group=groups.pp_group)
    received = buffer.cpu().numpy().tobytes()
    total = 8 + int.from_bytes(received[:8], "little")
    if total > _PAYLOAD_BYTES:
        rest = torch.zeros(total - _PAYLOAD_BYTES, dtype=torch.uint8)
        if groups.is_pipeline_last_stage:
            rest = torch.frombuffer(bytearray(blob[_PAYLOAD_BYTES:]), dtype=torch.uint8)
        rest = rest.to(device)
        dist.broadcast(rest, src=groups.pp_last_rank, group=groups.pp_group)
        received += rest.cpu().numpy().tobytes()
    return cast(dict[str, Any], pickle.loads(received[8:total]))  # noqa: S301 - our own ranks


def _reduce_over_dp(
    values: Mapping[str, float],
    rules: Mapping[str, ReductionRule],
    counts: Mapping[str, float],
    losses: Sequence[float],
    failed: bool,
    groups: ParallelGroups,
    device: torch.device | str,
) -> tuple[dict[str, float], dict[str, float], list[float]] | None:
    """`(metrics, counts, losses)` reduced over DP, or `None` on every rank when any rank
    `failed`."""
    # one fp64 all-gather, none at DP=1; each entry combined by its rule (`metrics.combine_rows`)
    # the vector also carries how many ranks hold each metric (held by none: dropped; by some:
    # reduced over those) and the error flag; it has one length on every DP rank since the step
    # runs the same number of microbatches on each (equal rows, checked by the input agreement;
    # token-budget counts agreed by MAX)
    names = sorted(rules)
    count_names = sorted(counts)
    identity = {"sum": 0.0, "min": math.inf, "max": -math.inf}
    count_kinds: list[Combine] = [
        "max" if k == "response_length_max" else "sum" for k in count_names
    ]
    kinds = (
        [rules[k].combine for k in names] + count_kinds + ["sum"] * (len(losses) + len(names) + 1)
    )
    local = torch.tensor(
        [values.get(k, identity[rules[k].combine]) for k in names]
        + [counts[k] for k in count_names]
        + list(losses)
        + [float(k in values) for k in names]
        + [float(failed)],
        dtype=torch.float64,
        device=device,
    )
    rows = [local]
    if groups.dp_size > 1:
        rows = [torch.empty_like(local) for _ in range(groups.dp_size)]
        dist.all_gather(rows, local, group=groups.dp_group)
    reduced = combine_rows(torch.stack(rows), kinds).cpu().tolist()  # the one host transfer
    n, c, m = len(names), len(count_names), len(losses)
    if reduced[-1] > 0:
        return None
    holders = reduced[n + c + m : 2 * n + c + m]
    metrics = {k: reduced[i] for i, k in enumerate(names) if holders[i] > 0}
    summed = {k: reduced[n + i] for i, k in enumerate(count_names)}
    return metrics, summed, reduced[n + c : n + c + m]
