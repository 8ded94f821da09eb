"""Multi-token prediction (MTP) in the training step (`MTPExtension`)."""

# The MTP term's weights `w = mask / N_t` per microbatch and the metrics `mtp_loss`
# (`mtp_<d>_loss` with `D > 1`).

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mcore_rl.extensions.noop import NoExtension
from lightning_mcore_rl.losses import MetricNormalizer
from lightning_mcore_rl.parallel import ParallelGroups, unwrap_model

if TYPE_CHECKING:
    from lightning_mcore_rl.train.model_inputs import ProcessedMicrobatch

MTP_LOSS = "mtp_loss"
"""Metric: the MTP cross entropy averaged over depths (unscaled by ``mtp_loss_scaling_factor``)."""


def mtp_depths(chunks: Sequence[torch.nn.Module]) -> int:
    """`D`: the model's `mtp_num_layers` (0 without multi-token prediction)."""
    from megatron.core.utils import get_model_config

    return int(get_model_config(chunks[0]).mtp_num_layers or 0)


def mtp_metric_normalizations(depths: int) -> dict[str, MetricNormalizer]:
    """The declared reductions of the MTP metrics of a `D = depths` model (`{}`: no MTP)."""
    if depths == 0:
        return {}
    # TOKENS: summed over microbatches and DP ranks, which gives the global token mean
    names = [MTP_LOSS] + ([f"mtp_{d + 1}_loss" for d in range(depths)] if depths > 1 else [])
    return dict.fromkeys(names, MetricNormalizer.TOKENS)


def mtp_loss_weights(mask: Tensor | None, global_valid_toks: Tensor | None) -> Tensor | None:
    """`w = mask / N_t` in the mask's layout (`[B, S_pad]` / `[1, T/CP]`); `mask` itself
    without a count (forward-only passes), `None` without a mask."""
    if mask is None or global_valid_toks is None:
        return mask
    # w weights the MTP term L_d = sum_t w[t + d + 2] CE_d[t]: each microbatch adds its share of
    # the global token mean, as the policy loss does (MTP losses are scaled by 1/N_t separately,
    # docs/behaviour-reference.md 2.5); prompt and padding tokens have w = 0
    return mask / global_valid_toks.to(mask.device).float().clamp(min=1.0)


def with_mtp_metrics(
    fn: Callable[[Tensor], tuple[Tensor, dict[str, Any]]],
    model: torch.nn.Module,
    groups: ParallelGroups,
) -> Callable[[Tensor], tuple[Tensor, dict[str, Any]]]:
    """`fn` (one microbatch's `f(output) -> (loss, metrics)`) with the MTP terms of `model`'s
    last forward added to its metrics.

    Raises:
        RuntimeError: the chunk recorded no MTP losses (not an `MTPGPTModel`).
    """
    inner = unwrap_model(model)
    losses = getattr(inner, "mtp_losses", None)
    if losses is None:
        raise RuntimeError(
            f"{type(inner).__name__} has `mtp_num_layers` set but recorded no `mtp_losses`; "
            "build it as lightning_mcore_rl.models.mtp.MTPGPTModel (tiny_gpt does)"
        )
    terms = losses.clone()  # [D]: this forward's, before the next microbatch overwrites them
    if groups.cp_size > 1:  # each context-parallel rank scores its own tokens
        dist.all_reduce(terms, group=groups.cp_group)

    def loss_and_metrics(output: Tensor) -> tuple[Tensor, dict[str, Any]]:
        loss, metrics = fn(output)
        metrics = dict(metrics)
        metrics[MTP_LOSS] = terms.mean()
        if terms.numel() > 1:
            metrics.update({f"mtp_{d + 1}_loss": term for d, term in enumerate(terms)})
        return loss, metrics

    return loss_and_metrics


class MTPExtension(NoExtension):
    """The MTP term of a training pass: its `mtp_loss_mask` built per microbatch, passed to the
    model as weights `mask / N_t`, its metrics added to the loss's."""

    def split_options(self, training: bool) -> dict[str, bool]:
        """The `mtp_loss_mask` per microbatch, in training passes."""
        # no backward otherwise, so forward-only passes build no MTP mask
        return {"mtp": training}

    def normalizations(
        self, chunks: Sequence[torch.nn.Module], training: bool
    ) -> Mapping[str, MetricNormalizer]:
        """The MTP metrics' reductions (training passes)."""
        return mtp_metric_normalizations(mtp_depths(chunks)) if training else {}

    def forward_kwargs(
        self, microbatch: ProcessedMicrobatch, global_valid_toks: Tensor | None
    ) -> dict[str, Any]:
        """`mtp_loss_mask`: the weights `mask / N_t` (`mtp_loss_weights`)."""
        weights = mtp_loss_weights(microbatch.mtp_loss_mask, global_valid_toks)
        return {} if weights is None else {"mtp_loss_mask": weights}

    def wrap_loss(
        self,
        fn: Callable[[Tensor], tuple[Tensor, dict[str, Any]]],
        model: torch.nn.Module,
        microbatch: ProcessedMicrobatch,
        groups: ParallelGroups,
        trains: bool,
    ) -> Callable[[Tensor], tuple[Tensor, dict[str, Any]]]:
        """A training loss of the last stage gets the MTP metrics (`with_mtp_metrics`)."""
        # only the last stage holds the MTP block and its recorded losses
        last = bool(getattr(unwrap_model(model), "post_process", True))
        if trains and microbatch.mtp_loss_mask is not None and last:
            return with_mtp_metrics(fn, model, groups)
        return fn


__all__ = [
    "MTPExtension",
    "MTP_LOSS",
    "mtp_depths",
    "mtp_loss_weights",
    "mtp_metric_normalizations",
    "with_mtp_metrics",
]
