"""Rank functions of the tiny-MoE layout tests (module-level: ``run_on_ranks`` pickles them)."""

from __future__ import annotations

from typing import Any

from lightning_mcore_rl.testing import init_megatron_state
from lightning_mcore_rl.testing.training import (
    build_training,
    gather_full_tensors,
    make_microbatches,
    train_step,
)

ROWS = 4
MOE = {"num_moe_experts": 4, "moe_router_topk": 2, "add_bias_linear": False}


def moe_train_step(_rank: int, tp: int, ep: int, etp: int | None, dispatcher: str) -> Any:
    """One megatron train step of the tiny MoE GPT (2 microbatches of ``ROWS`` rows, split over
    DP): ``(grad norm, full grads by canonical name, full params after the step)``."""
    import torch.distributed as dist

    from lightning_mcore_rl.parallel import megatron_groups

    init_megatron_state(
        tensor_model_parallel_size=tp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )
    setup = build_training(**MOE, moe_token_dispatcher_type=dispatcher, sequence_parallel=tp > 1)
    groups = megatron_groups()
    dp_rows = ROWS // groups.dp_size
    microbatches = [
        {key: value[groups.dp_rank * dp_rows : (groups.dp_rank + 1) * dp_rows]
         for key, value in mb.items()}
        for mb in make_microbatches(2, ROWS, 16)
    ]  # fmt: skip
    _, grad_norm = train_step(setup, microbatches)
    grads = gather_full_tensors(setup, grads=True)
    params = gather_full_tensors(setup, grads=False)
    dist.barrier()
    return grad_norm, grads, params
