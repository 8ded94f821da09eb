"""The policy settings the training step reads (the seed's ``PolicyConfig`` subset)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PolicyConfig:
    """Policy settings used by the post-processors (`load_policy_config`)."""

    # from NeMo RL's nested policy mapping (`sequence_packing.enabled`,
    # `sequence_packing.fuse_loss`, `logprob_chunk_size`, `draft.loss_weight`); other policy
    # keys are ignored
    sequence_packing: bool = False
    """Microbatches are packed into one THD row (``sequence_packing.enabled``)."""
    fuse_loss: bool = False
    """Packed losses run once per microbatch (:class:`SequencePackingFusionLossWrapper`)."""
    logprob_chunk_size: int | None = None
    """Sequence chunk of the logprob/top-k kernels (``None``: unchunked)."""
    draft_loss_weight: float = 1.0
    """Weight of the draft-model loss (``draft.loss_weight``)."""
    fused_gradient_in_forward: bool = False
    """The fused LM head computes its gradients in the forward for a token-local loss
    (``LogprobKernelConfig.fused_gradient_in_forward``; not a NeMo RL policy key)."""

    def __post_init__(self) -> None:
        """Validate the chunk size."""
        if self.logprob_chunk_size is not None and self.logprob_chunk_size <= 0:
            raise ValueError(
                f"`logprob_chunk_size` must be a positive int or None, got "
                f"{self.logprob_chunk_size}"
            )
        if self.fuse_loss and not self.sequence_packing:
            raise ValueError("`sequence_packing.fuse_loss=True` needs `sequence_packing.enabled`")


def load_policy_config(cfg: PolicyConfig | Mapping[str, Any] | None) -> PolicyConfig:
    """A `PolicyConfig` from itself, `None` (defaults) or NeMo RL's policy mapping.

    Raises:
        TypeError: `cfg` is of another type.
    """
    # a mapping such as `{"sequence_packing": {"enabled": True, "fuse_loss": False},
    # "logprob_chunk_size": 256, "draft": {"loss_weight": 0.5}}`
    if cfg is None:
        return PolicyConfig()
    if isinstance(cfg, PolicyConfig):
        return cfg
    if not isinstance(cfg, Mapping):
        raise TypeError(f"`cfg` must be a PolicyConfig or a mapping, got {type(cfg).__name__}")
    packing = cfg.get("sequence_packing") or {}
    draft = cfg.get("draft") or {}
    defaults = PolicyConfig()
    return PolicyConfig(
        sequence_packing=bool(packing.get("enabled", defaults.sequence_packing)),
        fuse_loss=bool(packing.get("fuse_loss", defaults.fuse_loss)),
        logprob_chunk_size=cfg.get("logprob_chunk_size", defaults.logprob_chunk_size),
        draft_loss_weight=float(draft.get("loss_weight", defaults.draft_loss_weight)),
    )
