"""Process groups (read from megatron once, by the strategy, and passed down) and CP/packing
layout helpers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.ops import (
    allgather_cp_sharded_tensor,
)

OutputProcessor = Callable[[Tensor], tuple[Tensor, dict[str, Any]]]
CP_NEEDS_PACKING = "Context Parallelism (CP>1) requires sequence packing to be enabled."


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's megatron process groups, ranks and sizes, read ONCE (by the strategy in
    ``setup_environment``, :func:`~lightning_mcore_rl.strategy.parallel.megatron_groups`) and
    passed down explicitly (:class:`~lightning_mcore_rl.train.StepContext`); nothing in
    ``train/`` reads megatron's ``parallel_state``.

    Attributes:
        tp_group: tensor-parallel group (``tp_rank``/``tp_size``).
        pp_group: pipeline-parallel group (``pp_rank``/``pp_size``; ``pp_last_rank`` is the
            global rank of this pipeline's last stage).
        dp_group: data-parallel group WITHOUT CP (CP ranks hold the same samples).
        cp_group: context-parallel group (``cp_rank``/``cp_size``).
        vpp_size: model chunks per pipeline rank (``None`` without virtual pipelining).
        mp_group: the model-parallel group (TP x PP) of this rank's replica (``None``: not
            given; the strategy's groups always carry it).
        ep_group: expert-parallel group (``ep_rank``/``ep_size``): the ranks whose experts
            together make each MoE layer's ``E`` experts; rank ``ep_rank`` holds experts
            ``[ep_rank * E/EP, (ep_rank + 1) * E/EP)``.
        etp_group: expert tensor-parallel group (``etp_rank``/``etp_size``): the ranks that
            shard one expert's weights. Defaults: EP = 1, and ``etp_size=-1`` makes the expert
            TP group the TP group (megatron's default).
    """

    tp_group: Any
    tp_rank: int
    tp_size: int
    pp_group: Any
    pp_rank: int
    pp_size: int
    pp_last_rank: int
    dp_group: Any
    dp_rank: int
    dp_size: int
    cp_group: Any
    cp_rank: int
    cp_size: int
    vpp_size: int | None = None
    mp_group: Any = None
    ep_group: Any = None
    ep_rank: int = 0
    ep_size: int = 1
    etp_group: Any = None
    etp_rank: int = -1
    etp_size: int = -1

    def __post_init__(self) -> None:
        if self.etp_size == -1:  # megatron's default: experts sharded like the dense layers
            object.__setattr__(self, "etp_group", self.tp_group)
            object.__setattr__(self, "etp_rank", self.tp_rank)
            object.__setattr__(self, "etp_size", self.tp_size)

    @classmethod
    def single(cls) -> ParallelGroups:
        """One process without parallelism: every rank 0, every size 1, no groups, no VPP."""
        return cls(
            tp_group=None, tp_rank=0, tp_size=1,
            pp_group=None, pp_rank=0, pp_size=1, pp_last_rank=0,
            dp_group=None, dp_rank=0, dp_size=1,
            cp_group=None, cp_rank=0, cp_size=1,
        )  # fmt: skip

    @property
    def is_pipeline_last_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage (the loss and the outputs)."""
        return self.pp_rank == self.pp_size - 1

    def is_first_stage(self, vp_stage: int | None) -> bool:
        """Whether chunk ``vp_stage`` of this rank is the model's first (it embeds the tokens):
        megatron's ``is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)``.

        Raises:
            ValueError: ``vp_stage`` is ``None`` under virtual pipelining.
        """
        self._check_vp_stage(vp_stage)
        return self.pp_rank == 0 and (self.vpp_size is None or vp_stage == 0)

    def is_last_stage(self, vp_stage: int | None) -> bool:
        """Whether chunk ``vp_stage`` of this rank is the model's last (it holds the output
        layer): megatron's ``is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)``.

        Raises:
            ValueError: ``vp_stage`` is ``None`` under virtual pipelining.
        """
        self._check_vp_stage(vp_stage)
        last_chunk = self.vpp_size is None or vp_stage == self.vpp_size - 1
        return self.is_pipeline_last_stage and last_chunk

    def _check_vp_stage(self, vp_stage: int | None) -> None:
        """Virtual pipelining needs a chunk index (megatron ignores ``vp_stage`` without)."""
        if self.vpp_size is not None and vp_stage is None:
            raise ValueError(
                f"`vp_stage` must be a chunk index in [0, {self.vpp_size}) under virtual "
                "pipelining, got None."
            )


def vocab_range(output: Tensor, tp_rank: int) -> tuple[int, int]:
    local_vocab = output.shape[-1]
    return tp_rank * local_vocab, (tp_rank + 1) * local_vocab


def host_ints(values: Tensor | Sequence[int]) -> list[int]:
    return [int(v) for v in (values.tolist() if torch.is_tensor(values) else values)]


def gather_packed_over_cp(local: Tensor, cu: list[int], cp_group: Any) -> Tensor:
    """``[1, T/CP, ...]`` per-span zigzag shards -> ``[1, T, ...]``, one all-gather per span."""
    cp_size = cp_group.size()
    full = local.new_zeros(1, cu[-1], *local.shape[2:])
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        if (
            end > start
        ):  # per sequence: gathering the whole row misplaces tokens (docs/behaviour-reference.md trap 3)
            span = local[:, start // cp_size : end // cp_size]
            full[:, start:end] = allgather_cp_sharded_tensor(span, cp_group, seq_dim=1)
    return full


def unpack_rows(full: Tensor, cu: list[int], lengths: Tensor | Sequence[int], width: int) -> Tensor:
    """``[1, T, ...]`` -> ``[B, S, ...]`` zeros + row ``i``'s first ``min(len_i, S)`` tokens."""
    lens = host_ints(lengths)
    out = full.new_zeros(len(lens), width, *full.shape[2:])
    for i, length in enumerate(lens):
        n = min(length, width)
        out[i, :n] = full[0, cu[i] : cu[i] + n]
    return out


def should_reduce_loss_across_context_parallel(data: BatchedDataDict | dict[str, Any]) -> bool:
    """Whether scalar loss reporting must include CP ranks (direct prepacked data, CP-local loss).

    Args:
        data: The batch.

    Returns:
        True iff ``"packed_cu_seqlens"`` is a key of ``data``.
    """
    return "packed_cu_seqlens" in data


def strip_context_parallel_local_loss_metric(
    metrics: dict[str, list[Any]], enabled: bool
) -> dict[str, list[Any]]:
    """Remove the CP-local ``"loss"`` metric list after it entered the global reduction.

    Args:
        metrics: Per-microbatch metric lists keyed by name.
        enabled: Whether the losses were CP-local (:func:`should_reduce_loss_across_context_parallel`).

    Returns:
        A new dict without ``"loss"`` when enabled, else ``metrics`` unchanged.
    """
    if not enabled:
        return metrics
    return {key: value for key, value in metrics.items() if key != "loss"}
