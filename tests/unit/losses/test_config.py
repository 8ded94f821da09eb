"""Config loading and construction-time validation."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_mcore_rl.losses import (
    ClippedPGLossConfig,
    ClippedPGLossFn,
    DistillationLossConfig,
    DistillationLossFn,
    DPOLossFn,
    LossType,
    MseValueLossFn,
    load_config,
)


def test_mapping_and_dataclass_are_equivalent() -> None:
    """A NeMo-RL-style dict and the dataclass build the same loss; None gives the defaults."""
    cfg = {"ratio_clip_min": 0.1, "ratio_clip_max": 0.28, "token_level_loss": False}
    from_dict = ClippedPGLossFn(cfg)
    from_dataclass = ClippedPGLossFn(ClippedPGLossConfig(**cfg))
    assert from_dict.cfg == from_dataclass.cfg
    assert from_dict.loss_type is LossType.SEQUENCE_LEVEL
    assert ClippedPGLossFn().cfg == ClippedPGLossConfig()
    assert load_config(DistillationLossConfig, None).kl_type == "mixed"


def test_unknown_keys_are_listed() -> None:
    """Unknown keys raise with the valid key list."""
    with pytest.raises(ValueError, match=r"Unknown key\(s\) \['ratio_clip'\].*valid keys are"):
        ClippedPGLossFn({"ratio_clip": 0.2})
    with pytest.raises(ValueError, match=r"Unknown key\(s\) \['beta'\] for DPOLossConfig"):
        DPOLossFn({"beta": 0.1})


def test_config_type_is_checked() -> None:
    """Neither mapping nor the dataclass: TypeError naming both."""
    with pytest.raises(TypeError, match="must be a ClippedPGLossConfig or a mapping, got int"):
        ClippedPGLossFn(3)  # type: ignore[arg-type]


TIS = {"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 2.0}
INVALID: list[tuple[str, dict[str, Any], str]] = [
    ("kl_type", {"reference_policy_kl_type": "k9"}, "`reference_policy_kl_type` must be one of"),
    ("aggregation", {"loss_aggregation": "sum"}, "`loss_aggregation` must be one of"),
    (
        "aggregation_conflict",
        {"token_level_loss": True, "loss_aggregation": "seq_mean_token_sum"},
        "contradicts",
    ),
    ("norm_constant", {"loss_aggregation": "seq_mean_token_sum_norm"}, "is required by"),
    ("stray_constant", {"loss_aggregation_constant": 4.0}, "is required by, and only used"),
    (
        "negative_constant",
        {"loss_aggregation": "seq_mean_token_sum_norm", "loss_aggregation_constant": -1.0},
        "must be > 0",
    ),
    ("clip_min", {"ratio_clip_min": -0.1}, "`ratio_clip_min` must be >= 0"),
    ("entropy", {"entropy_coef": -1.0}, "`entropy_coef` must be >= 0"),
    ("dual_clip", {"ratio_clip_c": 1.0}, "`ratio_clip_c` must exceed 1"),
    (
        "reinforce_forced",
        {"disable_ppo_ratio": True, "force_on_policy_ratio": True},
        "mutually exclusive",
    ),
    ("gspo_token", {"sequence_level_importance_ratios": True}, "needs a sequence-level loss"),
    ("cispo_reinforce", {"use_cispo": True, "disable_ppo_ratio": True}, "`disable_ppo_ratio`"),
    (
        "cispo_forced",
        {"use_cispo": True, "force_on_policy_ratio": True},
        "incompatible with `force_on_policy_ratio`",
    ),
    (
        "cispo_gspo",
        {"use_cispo": True, "sequence_level_importance_ratios": True, "token_level_loss": False},
        "incompatible with `sequence_level_importance_ratios`",
    ),
    ("cispo_dual", {"use_cispo": True, "ratio_clip_c": 3.0}, "incompatible with `ratio_clip_c`"),
    ("cispo_seq", {"use_cispo": True, "token_level_loss": False}, "requires a token-level loss"),
    (
        "tis_without_type",
        {"truncated_importance_sampling_ratio": 2.0},
        "`truncated_importance_sampling_type` is None",
    ),
    (
        "tis_type",
        {**TIS, "truncated_importance_sampling_type": "clip"},
        "`truncated_importance_sampling_type` must be one of",
    ),
    (
        "tis_without_is",
        {"truncated_importance_sampling_type": "tis", "truncated_importance_sampling_ratio": 2.0},
        "requires `use_importance_sampling_correction=True`",
    ),
    (
        "tis_ratio",
        {
            **TIS,
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio": 0,
        },
        "must be a positive number",
    ),
    (
        "tis_min_max",
        {
            **TIS,
            "truncated_importance_sampling_type": "tis",
            "truncated_importance_sampling_ratio_min": 3.0,
        },
        "truncated_importance_sampling_ratio_min must be <= truncated_importance_sampling_ratio",
    ),
    (
        "icepop_min",
        {**TIS, "truncated_importance_sampling_type": "icepop"},
        "requires `truncated_importance_sampling_ratio_min`",
    ),
    (
        "seq_mask_gspo",
        {
            **TIS,
            "truncated_importance_sampling_type": "seq-mask-tis",
            "truncated_importance_sampling_ratio_min": 0.5,
            "sequence_level_importance_ratios": True,
            "token_level_loss": False,
        },
        "incompatible with `sequence_level_importance_ratios=True`",
    ),
]


@pytest.mark.parametrize(("name", "cfg", "match"), INVALID, ids=[i[0] for i in INVALID])
def test_clipped_pg_rejects_incompatible_options(
    name: str, cfg: dict[str, Any], match: str
) -> None:
    """Every incompatible option combination is rejected at construction."""
    with pytest.raises(ValueError, match=match):
        ClippedPGLossFn(cfg)


def test_other_configs_validate() -> None:
    """Distillation, DPO and value configs validate their ranges."""
    with pytest.raises(ValueError, match="`kl_type` must be one of"):
        DistillationLossFn({"kl_type": "js"})
    with pytest.raises(ValueError, match=r"`mixed_kl_weight` must be in \[0, 1\], got 1.5"):
        DistillationLossFn({"mixed_kl_weight": 1.5})
    with pytest.raises(ValueError, match="`sft_loss_weight` must be >= 0"):
        DPOLossFn({"sft_loss_weight": -1.0})
    with pytest.raises(ValueError, match="`cliprange` must be None or >= 0"):
        MseValueLossFn({"cliprange": -0.2})
