"""The step's frozen context: everything a pass reads besides the batch and the chunks."""

# Built once by the strategy's `setup` and passed down explicitly: nothing below reads
# megatron's `parallel_state`.

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.parallel import ParallelGroups
from lightning_mcore_rl.train.model_inputs import check_microbatching
from lightning_mcore_rl.train.policy_config import PolicyConfig

if TYPE_CHECKING:
    from lightning_mcore_rl.train.extension import StepExtension


@dataclass(frozen=True)
class Microbatching:
    """How a global batch is split into microbatches (validated once, at construction).

    Attributes:
        micro_batch_size: samples per fixed-size microbatch (must stay 1 with a token budget).
        max_tokens_per_microbatch: token budget per microbatch (`None`: fixed size).
        sequence_packing: pack each microbatch into one THD row.
        equal_shapes: every microbatch gets the same shape (pipeline parallelism).
        sequence_parallel: the model runs megatron sequence parallelism.
    """

    micro_batch_size: int = 1
    # THD tokens when packing, else rows x longest row; needs per-sample `input_lengths`
    max_tokens_per_microbatch: int | None = None
    sequence_packing: bool = False
    # megatron's p2p sends one shape; padded token-budget microbatches cannot, so that raises
    equal_shapes: bool = False
    # packed spans are padded to a multiple of `2*CP*TP` (`TP` without CP), padded rows to a
    # multiple of `TP` (`model_inputs.layout_padding`)
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        check_microbatching(
            self.micro_batch_size,
            self.max_tokens_per_microbatch,
            sequence_packing=self.sequence_packing,
            equal_shapes=self.equal_shapes,
        )


@dataclass(frozen=True)
class StepContext:
    """What every pass of a run reads, frozen (built once by the strategy's `setup`).

    Attributes:
        groups: this rank's process groups, ranks and sizes.
        microbatching: how a global batch is split.
        policy: the post-processors' settings (packing, logprob chunk size).
        use_fused_linear_logprobs: the fused LM head (`train/fused.py`).
        sampling_params: the module's sampling parameters (`None`: plain softmax).
        device: where the step's collectives' tensors live (the CUDA device under NCCL).
        world_group: all ranks with the strategy's timeout (`None`: the default group).
        defer_fp32_logits: keep the last stage's logits in the model dtype (`None`: where exact).
        draft_model: the megatron-DDP EAGLE draft on the last pipeline stage, else `None`.
        train_draft: a draft is trained (on every rank, also those without one).
        extensions: the step's extensions (`None`: from the chunks' config, per pass).
    """

    groups: ParallelGroups
    microbatching: Microbatching = field(default_factory=Microbatching)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    use_fused_linear_logprobs: bool = False
    sampling_params: TrainingSamplingParams | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    world_group: Any = None
    # `None`: `logits_dtype.defers_fp32_logits` decides per pass
    defer_fp32_logits: bool | None = None
    draft_model: Any = None
    train_draft: bool = False
    # `None`: the ones the chunks' config turns on, looked up per pass (`step_extensions`)
    extensions: tuple[StepExtension, ...] | None = None

    def __post_init__(self) -> None:
        if self.draft_model is not None and not self.train_draft:
            raise ValueError("StepContext: a `draft_model` needs `train_draft=True`")
        # the draft's teacher is the policy's logits
        if self.train_draft and self.use_fused_linear_logprobs:
            raise ValueError(
                "draft-model training needs the policy's logits (its teacher), which "
                "`use_fused_linear_logprobs=True` never forms; turn one of them off"
            )


__all__ = ["Microbatching", "StepContext"]
