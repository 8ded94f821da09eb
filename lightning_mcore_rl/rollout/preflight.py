"""What every rank checks before a rollout's first collective: finite weights and equal prompts
per replica, in one all-gather. Shapes: ``B`` prompts, ``P`` prompt tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mcore_rl.reliability.agreement import (
    NONFINITE,
    OK,
    RankInput,
    check_replica_agreement,
    gather_inputs,
)
from lightning_mcore_rl.train.validation import batch_fingerprint

if TYPE_CHECKING:
    from lightning_mcore_rl.rollout.policy import RolloutSetup

_WRAPPER = "module."
"""The head megatron's DDP and Float16Module wrappers add to a chunk's parameter names."""


class NonFiniteWeightError(ValueError):
    """The model that samples holds NaN/inf weights (raised on every rank alike)."""


def first_nonfinite_parameter(chunks: Sequence[torch.nn.Module]) -> str | None:
    """The first parameter of ``chunks`` holding NaN/inf, described (``"name (chunk c): n of m
    entries NaN/inf"``), or ``None``."""
    named = [
        (c, name, param)
        for c, chunk in enumerate(chunks)
        for name, param in chunk.named_parameters()
    ]
    if not named:
        return None
    # one host sync when every weight is finite
    finite = torch.stack([torch.isfinite(param).all() for _, _, param in named])
    if bool(finite.all()):
        return None
    c, name, param = named[int((~finite).nonzero()[0])]
    while name.startswith(_WRAPPER):
        name = name[len(_WRAPPER) :]
    bad = int((~torch.isfinite(param)).sum())
    chunk = f" (chunk {c})" if len(chunks) > 1 else ""
    return f"`{name}`{chunk}: {bad} of {param.numel()} entries NaN/inf"


def check_before_rollout(
    setup: RolloutSetup, prompts: Tensor, prompt_lengths: Tensor | None = None
) -> None:
    """Agree over ``setup.world_group`` that the sampling weights are finite and that each
    replica's ranks hold the same ``prompts [B, P]`` (and ``prompt_lengths [B]``).

    Raises:
        NonFiniteWeightError: a weight is NaN/inf on some rank (on every rank, naming it).
        BatchMismatchError: the ranks of a replica hold different prompts (on every rank)."""
    # One all-gather of each rank's weight verdict and prompt summary (the step's agreement
    # table, `reliability.agreement`), so every rank takes the same decision.
    # A NaN/inf weight comes from outside the optimizer (its update check never writes one): a
    # callback writing into the weights, a checkpoint saved without the strategy's checksums.
    bad = first_nonfinite_parameter(setup.chunks)
    keyed = {"prompts": prompts}
    if prompt_lengths is not None:
        keyed["prompt_lengths"] = prompt_lengths
    # a malformed batch still joins the all-gather (`check_prompts` refuses it later), so no
    # rank waits alone
    rows, width = (int(n) for n in prompts.shape[:2]) if prompts.dim() >= 2 else (0, 0)
    entry = RankInput(
        NONFINITE if bad is not None else OK, setup.groups.dp_rank, rows, width,
        batch_fingerprint(keyed),
    )  # fmt: skip
    table = gather_inputs(entry, _device(setup.chunks), setup.world_group)
    if int(table[:, 0].max()) != OK:  # column 0: the verdict (RankInput's order)
        # raised on every rank, not torch.multinomial's "probability tensor contains inf, nan"
        # on some
        raise NonFiniteWeightError(_nonfinite_message(bad, setup.world_group))
    # A replica's TP/PP ranks sample together: different prompts (rows, width or contents)
    # would reach a collective of mismatched shapes, which gloo answers by aborting the process.
    check_replica_agreement(table, "Before the rollout: ")


def _device(chunks: Sequence[torch.nn.Module]) -> torch.device:
    """Where the chunks' parameters live (the collective's device: gloo CPU, NCCL CUDA)."""
    for chunk in chunks:
        for param in chunk.parameters():
            return param.device
    return torch.device("cpu")


def _nonfinite_message(bad: str | None, group: Any) -> str:
    """Every rank's finding in one message, the same on every rank."""
    # an all_gather_object is affordable here: the failure path only
    found: list[str | None] = [bad]
    if dist.is_available() and dist.is_initialized():
        found = [None] * dist.get_world_size(group)
        dist.all_gather_object(found, bad, group=group)
    where = "; ".join(f"{text} on rank {rank}" for rank, text in enumerate(found) if text)
    return (
        f"The model that samples the rollout holds non-finite weights: {where}. Sampling from "
        "them fails (torch.multinomial: 'probability tensor contains inf, nan'). The "
        "strategy's update check never writes them, so they came from outside the optimizer: "
        "a callback writing into the weights, or a checkpoint saved by another tool. Resume "
        "from a checkpoint with finite weights (`ckpt_path=`) or fix what wrote them."
    )


__all__ = ["NonFiniteWeightError", "check_before_rollout", "first_nonfinite_parameter"]
