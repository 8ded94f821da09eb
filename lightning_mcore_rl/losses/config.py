"""Typed loss configs and the one loader that maps NeMo-RL-style dicts onto them."""

# Every loss takes a config dataclass (LightningCLI builds these from YAML) or a plain mapping
# with the reference's keys, so a NeMo RL `loss_fn:` section carries over unchanged. Each
# dataclass validates itself once, in `__post_init__`.

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from lightning_mcore_rl.losses.utils import KLType, LossAggregation

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ConfigT = TypeVar("ConfigT", bound="DataclassInstance")
TISType = Literal["tis", "icepop", "seq-mask-tis"]
DistillationKLType = Literal["forward", "reverse", "mixed"]

_KL_TYPES = ("k1", "k2", "k3")
_AGGREGATIONS = (
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)
_TIS_TYPES = ("tis", "icepop", "seq-mask-tis")


def load_config(config_cls: type[ConfigT], cfg: ConfigT | Mapping[str, Any] | None) -> ConfigT:
    """`config_cls` from an instance, a mapping of its field names, or `None` (all defaults).

    Raises:
        ValueError: the mapping has keys that are not fields of `config_cls`.
        TypeError: `cfg` is neither an instance nor a mapping.
    """
    if cfg is None:
        return config_cls()
    if isinstance(cfg, config_cls):
        return cfg
    if not isinstance(cfg, Mapping):
        raise TypeError(
            f"The loss config must be a {config_cls.__name__} or a mapping, "
            f"got {type(cfg).__name__}."
        )
    valid = [f.name for f in dataclasses.fields(config_cls)]
    # rejected with the valid keys listed: a typo would otherwise fall back to a default silently
    unknown = sorted(set(cfg) - set(valid))
    if unknown:
        raise ValueError(
            f"Unknown key(s) {unknown} for {config_cls.__name__}; valid keys are {valid}."
        )
    return config_cls(**dict(cfg))


def _check_choice(name: str, value: Any, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {list(choices)}, got {value!r}.")


def _check_finite(config: Any) -> None:
    """Raise a `ValueError` unless every float field of a loss config is finite."""
    # A NaN compares False with every bound, so `ratio_clip_max=nan` would pass the range checks
    # below and clip nothing (inf likewise).
    for item in dataclasses.fields(config):
        value = getattr(config, item.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(
                f"`{type(config).__name__}.{item.name}` must be a finite number, got {value}."
            )


@dataclass(frozen=True)
class ClippedPGLossConfig:
    """Config of `ClippedPGLossFn` (keys and defaults of NeMo RL's `loss_fn` section)."""

    reference_policy_kl_penalty: float = 0.01
    """beta of the reference-KL term in the loss (0 disables it)."""
    reference_policy_kl_type: KLType = "k3"
    """KL estimator of the reference penalty and of the ``gen/policy_kl_error`` diagnostics."""
    kl_input_clamp_value: float | None = 20.0
    """Clamp of the log-ratio inside the reference KL (``None`` disables it)."""
    kl_output_clamp_value: float | None = 10.0
    """Clamp of the per-token reference KL (``None`` disables it)."""
    ratio_clip_min: float = 0.2
    """eps_low: the ratio is clipped from below at ``1 - ratio_clip_min``."""
    ratio_clip_max: float = 0.2
    """eps_high: the ratio is clipped from above at ``1 + ratio_clip_max``."""
    ratio_clip_c: float | None = None
    """Dual-clip constant c > 1 (arXiv:1912.09729); ``None`` disables dual clipping."""
    use_on_policy_kl_approximation: bool = False
    """Weight the reference KL by ``exp(curr - generation)`` (samples come from pi_gen)."""
    use_importance_sampling_correction: bool = False
    """Multiply the actor loss by the pi_prev / pi_gen importance weights."""
    truncated_importance_sampling_type: TISType | None = None
    """``"tis"`` clamps, ``"icepop"`` zeroes tokens, ``"seq-mask-tis"`` drops sequences."""
    truncated_importance_sampling_ratio: float | None = None
    """Upper bound of the importance weight for truncation."""
    truncated_importance_sampling_ratio_min: float | None = None
    """Lower bound (required by icepop and seq-mask-tis; 0 for tis when unset)."""
    token_level_loss: bool | None = None
    """NeMo RL's switch: True = ``token_mean``, False = ``seq_mean_token_mean``. ``None``: derived
    from ``loss_aggregation`` (``token_mean`` when that is unset too)."""
    loss_aggregation: LossAggregation | None = None
    """Dr.GRPO/veRL aggregation; ``None`` follows ``token_level_loss``."""
    loss_aggregation_constant: float | None = None
    """Constant C of ``seq_mean_token_sum_norm`` (e.g. the maximum generation length)."""
    sequence_level_importance_ratios: bool = False
    """GSPO: one ratio per sequence, ``exp(mean_t(curr - prev))``, and sequence IS weights."""
    disable_ppo_ratio: bool = False
    """REINFORCE: per-token loss ``-A * curr_logprob`` (no ratio, no clipping)."""
    force_on_policy_ratio: bool = False
    """Use ``curr.detach()`` as the old logprobs (ratio 1, gradient kept)."""
    use_kl_in_reward: bool = False
    """The KL is already in the reward: forces ``reference_policy_kl_penalty`` to 0 in the loss."""
    use_cispo: bool = False
    """CISPO (arXiv:2506.13585): per-token loss ``-A * sg(clip(r)) * curr_logprob``."""
    positive_example_nll_weight: float = 0.0
    """mu of VAPO's NLL term on tokens of samples with ``rewards > 0`` (needs ``rewards``)."""
    entropy_coef: float = 0.0
    """Entropy bonus: the loss subtracts ``entropy_coef * aggregate(entropy)``."""

    def __post_init__(self) -> None:
        """Validate the options and their combinations."""
        _check_finite(self)
        _check_choice("reference_policy_kl_type", self.reference_policy_kl_type, _KL_TYPES)
        if self.loss_aggregation is not None:
            _check_choice("loss_aggregation", self.loss_aggregation, _AGGREGATIONS)
            if self.token_level_loss is not None and self.token_level_loss != (
                self.loss_aggregation == "token_mean"
            ):
                raise ValueError(
                    f"`token_level_loss={self.token_level_loss}` contradicts "
                    f"`loss_aggregation={self.loss_aggregation!r}`; set only one of them."
                )
        if (self.aggregation == "seq_mean_token_sum_norm") != (
            self.loss_aggregation_constant is not None
        ):
            raise ValueError(
                "`loss_aggregation_constant` is required by, and only used with, "
                f"`loss_aggregation='seq_mean_token_sum_norm'` (got aggregation "
                f"{self.aggregation!r}, constant {self.loss_aggregation_constant})."
            )
        if self.loss_aggregation_constant is not None and self.loss_aggregation_constant <= 0:
            raise ValueError(
                f"`loss_aggregation_constant` must be > 0, got {self.loss_aggregation_constant}."
            )
        for name in (
            "ratio_clip_min",
            "ratio_clip_max",
            "positive_example_nll_weight",
            "reference_policy_kl_penalty",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}.")
        if self.entropy_coef < 0:
            raise ValueError(f"`entropy_coef` must be >= 0, got {self.entropy_coef}.")
        if self.ratio_clip_c is not None and self.ratio_clip_c <= 1:
            raise ValueError(
                f"`ratio_clip_c` must exceed 1 (a lower bound on -A*ratio for A<0), "
                f"got {self.ratio_clip_c}; set it to None to disable dual clipping."
            )
        if self.disable_ppo_ratio and self.force_on_policy_ratio:
            raise ValueError(
                "`disable_ppo_ratio` (REINFORCE) and `force_on_policy_ratio` (ratio 1) are "
                "mutually exclusive; set one of them."
            )
        if self.sequence_level_importance_ratios and self.aggregation == "token_mean":
            raise ValueError(
                "`sequence_level_importance_ratios=True` (GSPO) needs a sequence-level loss: "
                "set `token_level_loss=False` or a `seq_mean_*` `loss_aggregation`."
            )
        self._check_cispo()
        self._check_tis()

    @property
    def aggregation(self) -> LossAggregation:
        """The effective aggregation mode."""
        if self.loss_aggregation is not None:
            return self.loss_aggregation
        return "seq_mean_token_mean" if self.token_level_loss is False else "token_mean"

    def _check_cispo(self) -> None:
        if not self.use_cispo:
            return
        conflicts = {
            "disable_ppo_ratio": self.disable_ppo_ratio,
            "force_on_policy_ratio": self.force_on_policy_ratio,
            "sequence_level_importance_ratios": self.sequence_level_importance_ratios,
            "ratio_clip_c": self.ratio_clip_c is not None,
        }
        for name, active in conflicts.items():
            if active:
                raise ValueError(
                    f"`use_cispo=True` is incompatible with `{name}`: CISPO needs the clipped "
                    "token-level ratio as a stop-gradient weight. Unset one of them."
                )
        if self.aggregation != "token_mean":
            raise ValueError(
                "`use_cispo=True` requires a token-level loss (`loss_aggregation='token_mean'`), "
                f"got {self.aggregation!r}."
            )

    def _check_tis(self) -> None:
        kind = self.truncated_importance_sampling_type
        ratio = self.truncated_importance_sampling_ratio
        ratio_min = self.truncated_importance_sampling_ratio_min
        if kind is None:
            if ratio is not None or ratio_min is not None:
                raise ValueError(
                    "`truncated_importance_sampling_ratio(_min)` is set but "
                    "`truncated_importance_sampling_type` is None; set the type to one of "
                    f"{list(_TIS_TYPES)}."
                )
            return
        _check_choice("truncated_importance_sampling_type", kind, _TIS_TYPES)
        if not self.use_importance_sampling_correction:
            raise ValueError(
                f"`truncated_importance_sampling_type={kind!r}` requires "
                "`use_importance_sampling_correction=True`."
            )
        if ratio is None or ratio <= 0:
            raise ValueError(
                f"`truncated_importance_sampling_ratio` must be a positive number, got {ratio}."
            )
        if ratio_min is not None and ratio_min > ratio:
            raise ValueError(
                "truncated_importance_sampling_ratio_min must be <= "
                f"truncated_importance_sampling_ratio (got {ratio_min} > {ratio})."
            )
        if kind in ("icepop", "seq-mask-tis") and ratio_min is None:
            raise ValueError(
                f"`truncated_importance_sampling_type={kind!r}` requires "
                "`truncated_importance_sampling_ratio_min`."
            )
        if kind == "seq-mask-tis" and self.sequence_level_importance_ratios:
            raise ValueError(
                "`truncated_importance_sampling_type='seq-mask-tis'` masks whole sequences of "
                "token-level weights and is incompatible with "
                "`sequence_level_importance_ratios=True`."
            )


@dataclass(frozen=True)
class DPOLossConfig:
    """Config of `DPOLossFn` (NeMo RL `dpo` keys)."""

    reference_policy_kl_penalty: float = 0.05
    """beta of the DPO sigmoid."""
    preference_loss_weight: float = 1.0
    """Weight of the preference term."""
    sft_loss_weight: float = 0.0
    """Weight of the NLL term on the chosen responses (0 disables it)."""
    preference_average_log_probs: bool = False
    """Average the implicit reward over tokens instead of summing."""
    sft_average_log_probs: bool = False
    """Average the per-sample SFT NLL over tokens instead of summing."""

    def __post_init__(self) -> None:
        """Validate the weights."""
        _check_finite(self)
        for name in ("preference_loss_weight", "sft_loss_weight", "reference_policy_kl_penalty"):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be >= 0, got {getattr(self, name)}.")


@dataclass(frozen=True)
class DistillationLossConfig:
    """Config of `DistillationLossFn` (top-k KL distillation)."""

    kl_type: DistillationKLType = "mixed"
    """``forward`` KL(t||s), ``reverse`` KL(s||t) or ``mixed`` w*fwd + (1-w)*rev."""
    mixed_kl_weight: float = 0.5
    """w of the mixed KL, in [0, 1]."""
    zero_outside_topk: bool = False
    """Treat the student's mass outside the teacher's top-k as matched against p_t = 0 (a
    ``log p = -100`` stand-in); adds the reverse-KL tail correction (needs ``H_all``)."""

    def __post_init__(self) -> None:
        """Validate the KL type and weight."""
        _check_finite(self)
        _check_choice("kl_type", self.kl_type, ("forward", "reverse", "mixed"))
        if not 0.0 <= self.mixed_kl_weight <= 1.0:
            raise ValueError(f"`mixed_kl_weight` must be in [0, 1], got {self.mixed_kl_weight}.")


@dataclass(frozen=True)
class MseValueLossConfig:
    """Config of `MseValueLossFn`."""

    scale: float = 1.0
    """Multiplier of the value loss."""
    cliprange: float | None = None
    """PPO value clipping range around the old values; ``None`` or 0 disables clipping."""

    def __post_init__(self) -> None:
        """Validate the clip range."""
        _check_finite(self)
        if self.cliprange is not None and self.cliprange < 0:
            raise ValueError(f"`cliprange` must be None or >= 0, got {self.cliprange}.")


@dataclass(frozen=True)
class OPDFullLossConfig:
    """Config of `OPDFullLossFn` (full-vocabulary on-policy distillation)."""

    reference_policy_kl_penalty: float = 0.0
    """beta of an extra reference-KL term (a second KL next to the distillation divergence)."""
    reference_policy_kl_type: KLType = "k3"
    """KL estimator of the reference term."""
    kl_input_clamp_value: float | None = 20.0
    """Clamp of the log-ratio inside the reference KL."""
    kl_output_clamp_value: float | None = 10.0
    """Clamp of the per-token reference KL."""
    token_level_loss: bool = True
    """True: token mean over the global batch; False: mean over sequences of token means."""

    def __post_init__(self) -> None:
        """Validate the KL type and penalty."""
        _check_finite(self)
        _check_choice("reference_policy_kl_type", self.reference_policy_kl_type, _KL_TYPES)
        if self.reference_policy_kl_penalty < 0:
            raise ValueError(
                "`reference_policy_kl_penalty` must be >= 0, got "
                f"{self.reference_policy_kl_penalty}."
            )
