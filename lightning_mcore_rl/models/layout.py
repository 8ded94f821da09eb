"""The parallel layout the model builders take (this rank's `ParallelGroups`): the config sizes
it implies, and the checks that a config was made for it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_mcore_rl.megatron_defaults import pipeline_p2p_settings

if TYPE_CHECKING:
    from lightning_mcore_rl.parallel import ParallelGroups

_SIZES = (
    ("tensor_model_parallel_size", "tp_size"),
    ("pipeline_model_parallel_size", "pp_size"),
    ("virtual_pipeline_model_parallel_size", "vpp_size"),
    ("context_parallel_size", "cp_size"),
    ("expert_model_parallel_size", "ep_size"),
    ("expert_tensor_parallel_size", "etp_size"),
)


def layout_groups(groups: ParallelGroups | None) -> ParallelGroups:
    """`groups`, or the single-rank layout (`ParallelGroups.single`) for `None`."""
    from lightning_mcore_rl.parallel import ParallelGroups

    return ParallelGroups.single() if groups is None else groups


def parallel_config_fields(groups: ParallelGroups) -> dict[str, Any]:
    """`TransformerConfig` fields of `groups`' layout: the TP/PP/VPP/CP/EP/ETP sizes and the
    pipeline p2p settings."""
    fields: dict[str, Any] = {field: getattr(groups, size) for field, size in _SIZES}
    return {**fields, **pipeline_p2p_settings(groups.vpp_size)}


def check_config_layout(config: Any, groups: ParallelGroups) -> None:
    """Refuse (`ValueError`, naming the field and both values) a model config made for another
    layout than `groups`, or MoE layers in a layout gloo cannot run (`check_expert_collectives`)."""
    for field, size in _SIZES:
        # e.g. a multi-rank config with `groups` omitted would otherwise build or load the wrong
        # shards; only sizes are read, so this runs before any collective
        if getattr(config, field) != getattr(groups, size):
            raise ValueError(
                f"The model config has {field}={getattr(config, field)!r} but `groups` has "
                f"{size}={getattr(groups, size)!r}: pass this rank's `groups` (e.g. "
                "`MCoreRLModule.parallel_groups` or the strategy's `groups`); omitted, it is "
                "the single-rank layout."
            )
    if getattr(config, "num_moe_experts", None):
        check_group_expert_collectives(groups, "The model's MoE layers")


def gloo_carries(backend: str, device_type: str) -> bool:
    """Whether gloo runs the collectives of `device_type` tensors under the process-group `backend`
    (`"gloo"`, `"nccl"` or a per-device map such as `"cpu:gloo,cuda:nccl"`)."""
    if ":" not in backend:
        return backend == "gloo"
    devices = dict(part.split(":", 1) for part in backend.split(",") if ":" in part)
    return devices.get(device_type) == "gloo"


def check_expert_collectives(
    tp: int, ep: int, expert_tp: int, backend: str, device_type: str, what: str
) -> None:
    """Refuse (`ValueError`, naming the sizes and the layouts that run) `ep > 1` with
    `expert_tp > 1` where gloo carries the collectives; `what` starts the message."""
    # reads only sizes and the backend's name: no collective
    if ep == 1 or expert_tp == 1 or not gloo_carries(backend, device_type):
        return
    # megatron's token dispatchers all-gather the tokens each expert-TP rank routed to this EP
    # rank's experts: counts that differ per rank under EP > 1 (at EP = 1 every rank sends all
    # its S/TP x top-k assignments, equal counts). NCCL gathers unequal sizes; gloo's allgather
    # refuses them ("invalid tensor size") on every rank in the first MoE forward.
    raise ValueError(
        f"{what}: expert tensor parallelism with expert parallelism (tp={tp}, ep={ep}, "
        f"expert_tp={expert_tp}) cannot run on gloo ({device_type}): megatron's MoE token "
        "dispatchers gather a different number of tokens from each expert-TP rank, which "
        "gloo's allgather refuses in the first MoE forward. Set "
        "`expert_tensor_parallel_size=1` (each EP rank holds whole experts; TP still shards "
        "the dense layers), or `expert_model_parallel_size=1` (experts sharded like the dense "
        "layers), or run on GPUs (NCCL)."
    )


def check_group_expert_collectives(groups: ParallelGroups, what: str) -> None:
    """`check_expert_collectives` for `groups`' sizes and the backend of its expert-TP group
    (nothing to check without an initialised process group)."""
    import torch
    import torch.distributed as dist

    if groups.ep_size == 1 or groups.etp_size == 1 or groups.etp_group is None:
        return
    if not (dist.is_available() and dist.is_initialized()):
        return
    backend = str(dist.get_backend(groups.etp_group))
    # the model builders run on CPU under the CUDA emulation, where is_available() stays False
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    check_expert_collectives(
        groups.tp_size, groups.ep_size, groups.etp_size, backend, device_type, what
    )
