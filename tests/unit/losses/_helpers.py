"""Shared builders and checks for the loss tests."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_mcore_rl.losses import combine_microbatch_metrics, rescale_metrics

DT = torch.float64


def t(values: Any) -> Tensor:
    """A float64 tensor."""
    return torch.tensor(values, dtype=DT)


def full_width(rows: list[list[float]]) -> Tensor:
    """Prepend the dropped position-0 column (value 99, never read) to ``[B, S-1]`` rows."""
    x = t(rows)
    return torch.cat([torch.full((x.shape[0], 1), 99.0, dtype=DT), x], dim=1)


def random_pg_batch(batch: int = 4, width: int = 6, seed: int = 0) -> dict[str, Tensor]:
    """A random policy-gradient batch of ``[B, S]`` fields with ragged token masks."""
    g = torch.Generator().manual_seed(seed)
    prev = -torch.rand(batch, width, generator=g, dtype=DT) * 2 - 0.1
    token_mask = torch.ones(batch, width, dtype=DT)
    for i in range(batch):
        token_mask[i, width - i % 3 :] = 0  # ragged lengths
    sample_mask = torch.ones(batch, dtype=DT)
    sample_mask[-1] = 0 if batch > 2 else 1
    return {
        "token_mask": token_mask,
        "sample_mask": sample_mask,
        "advantages": torch.randn(batch, width, generator=g, dtype=DT),
        "prev_logprobs": prev,
        "generation_logprobs": prev + 0.3 * torch.randn(batch, width, generator=g, dtype=DT),
        "reference_policy_logprobs": prev + 0.5 * torch.randn(batch, width, generator=g, dtype=DT),
        "rewards": torch.tensor([1.0, -1.0, 0.5, 0.0] * batch, dtype=DT)[:batch],
    }


def random_logprobs(data: Mapping[str, Tensor], scale: float = 0.3, seed: int = 1) -> Tensor:
    """Current logprobs ``[B, S-1]`` near the previous policy's."""
    g = torch.Generator().manual_seed(seed)
    prev = data["prev_logprobs"][:, 1:]
    return (prev + scale * torch.randn(prev.shape, generator=g, dtype=DT)).requires_grad_(True)


def counts(data: Mapping[str, Tensor]) -> tuple[float, float]:
    """``(global_valid_seqs, global_valid_toks)`` of a whole batch.

    See docs/behaviour-reference.md §2.10.
    """
    sm = data["sample_mask"]
    return float(sm.sum()), float((data["token_mask"][:, 1:] * sm.unsqueeze(-1)).sum())


def slice_rows(mapping: Mapping[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Rows ``[start, stop)`` of every tensor."""
    return {k: v[start:stop] if isinstance(v, Tensor) else v for k, v in mapping.items()}


def assert_metrics_close(a: Mapping[str, float], b: Mapping[str, float], atol: float) -> None:
    """Same keys, values within ``atol`` (relative for large values), infinities equal."""
    assert set(a) == set(b), set(a) ^ set(b)
    for key in a:
        x, y = float(a[key]), float(b[key])
        if math.isinf(x) or math.isinf(y):
            assert x == y, (key, x, y)
        else:
            assert abs(x - y) <= atol * max(1.0, abs(y)), (key, x, y)


def check_invariance(
    loss_fn: Callable[..., tuple[Tensor, dict[str, Tensor]]],
    data: Mapping[str, Any],
    loss_input: Mapping[str, Tensor],
    num_microbatches: int,
    seqs: float,
    toks: float,
    atol: float = 1e-6,
) -> None:
    """Split into microbatches; summed losses and combined metrics equal the whole batch's.

    Also replays the split with placeholder counts 1 and checks that rescaling the combined
    metrics by their normaliser recovers the whole-batch metrics.
    """
    norms = loss_fn.metric_normalizations  # type: ignore[attr-defined]
    whole_loss, whole_metrics = loss_fn(data, seqs, toks, **loss_input)
    whole = combine_microbatch_metrics([whole_metrics], norms)
    batch = next(iter(loss_input.values())).shape[0]
    size = batch // num_microbatches
    parts, placeholder_parts, total = [], [], torch.zeros((), dtype=DT)
    for i in range(num_microbatches):
        d = slice_rows(data, i * size, (i + 1) * size)
        li = slice_rows(loss_input, i * size, (i + 1) * size)
        loss, metrics = loss_fn(d, seqs, toks, **li)
        total = total + loss
        parts.append(metrics)
        placeholder_parts.append(loss_fn(d, 1.0, 1.0, **li)[1])
    assert abs(float(total.detach()) - float(whole_loss.detach())) <= atol
    assert_metrics_close(combine_microbatch_metrics(parts, norms), whole, atol)
    rescaled = rescale_metrics(
        combine_microbatch_metrics(placeholder_parts, norms), norms, seqs, toks
    )
    assert_metrics_close(rescaled, whole, atol)
