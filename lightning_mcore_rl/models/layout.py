"""The parallel layout the model builders take as an argument (this rank's
:class:`~lightning_mcore_rl.train.ParallelGroups`, read once by the strategy): the config sizes
it implies, and the check that a config was made for it."""

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
    """``groups``, or the single-rank layout (:meth:`ParallelGroups.single`) for ``None``."""
    from lightning_mcore_rl.parallel import ParallelGroups

    return ParallelGroups.single() if groups is None else groups


def parallel_config_fields(groups: ParallelGroups) -> dict[str, Any]:
    """``TransformerConfig`` fields of ``groups``' layout: TP, PP, VPP, CP, EP and ETP sizes and the
    pipeline p2p settings (:func:`~lightning_mcore_rl.megatron_defaults.pipeline_p2p_settings`)."""
    fields: dict[str, Any] = {field: getattr(groups, size) for field, size in _SIZES}
    return {**fields, **pipeline_p2p_settings(groups.vpp_size)}


def check_config_layout(config: Any, groups: ParallelGroups) -> None:
    """Refuse a model config made for another layout than ``groups`` (e.g. a multi-rank config
    with ``groups`` omitted, which would otherwise build or load the wrong shards). Reads only
    sizes, so it runs before any collective.

    Raises:
        ValueError: naming the config field, ``groups``' size and both values.
    """
    for field, size in _SIZES:
        if getattr(config, field) != getattr(groups, size):
            raise ValueError(
                f"The model config has {field}={getattr(config, field)!r} but `groups` has "
                f"{size}={getattr(groups, size)!r}: pass this rank's `groups` (e.g. "
                "`MCoreRLModule.parallel_groups` or the strategy's `groups`); omitted, it is "
                "the single-rank layout."
            )
