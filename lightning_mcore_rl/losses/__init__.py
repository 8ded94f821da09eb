"""Loss functions for RL, preference learning and distillation: pure tensor code.

Every loss follows `LossFunction`, `loss_fn(data, global_valid_seqs, global_valid_toks,
**loss_input) -> (loss, metrics)`; loss inputs have width `S-1`, data fields width `S`.
"""

# Normalising by the *global* counts makes per-microbatch losses sum to the global-batch loss.
# Loss inputs are S-1 wide by the next-token convention (position t predicts token t + 1).

from lightning_mcore_rl.losses.config import (
    ClippedPGLossConfig,
    DistillationLossConfig,
    DPOLossConfig,
    MseValueLossConfig,
    OPDFullLossConfig,
    load_config,
)
from lightning_mcore_rl.losses.distillation import DistillationLossFn, OPDFullLossFn
from lightning_mcore_rl.losses.draft_loss import DraftCrossEntropyLossFn
from lightning_mcore_rl.losses.interfaces import (
    MEAN_RULE,
    REDUCTION_RULES,
    LossFunction,
    LossInputType,
    LossType,
    MetricNormalizer,
    ReductionRule,
    combine_microbatch_metrics,
    rescale_metrics,
)
from lightning_mcore_rl.losses.loss_input import (
    _prepare_opd_full_loss_input,
    prepare_loss_input,
    prepare_packed_loss_input,
)
from lightning_mcore_rl.losses.nll import NLLLossFn
from lightning_mcore_rl.losses.policy_gradient import ClippedPGLossFn
from lightning_mcore_rl.losses.preference import DPOLossFn, PreferenceLossFn
from lightning_mcore_rl.losses.utils import calculate_kl, masked_mean
from lightning_mcore_rl.losses.value import MseValueLossFn
from lightning_mcore_rl.losses.wrappers import (
    DraftLossWrapper,
    SequencePackingFusionLossWrapper,
    SequencePackingLossWrapper,
    wrap_loss_fn_with_input_preparation,
)

__all__ = [
    "ClippedPGLossConfig",
    "ClippedPGLossFn",
    "DPOLossConfig",
    "DPOLossFn",
    "DistillationLossConfig",
    "DistillationLossFn",
    "DraftCrossEntropyLossFn",
    "DraftLossWrapper",
    "LossFunction",
    "LossInputType",
    "LossType",
    "MEAN_RULE",
    "MetricNormalizer",
    "REDUCTION_RULES",
    "ReductionRule",
    "MseValueLossConfig",
    "MseValueLossFn",
    "NLLLossFn",
    "OPDFullLossConfig",
    "OPDFullLossFn",
    "PreferenceLossFn",
    "SequencePackingFusionLossWrapper",
    "SequencePackingLossWrapper",
    "_prepare_opd_full_loss_input",
    "calculate_kl",
    "combine_microbatch_metrics",
    "load_config",
    "masked_mean",
    "prepare_loss_input",
    "prepare_packed_loss_input",
    "rescale_metrics",
    "wrap_loss_fn_with_input_preparation",
]
