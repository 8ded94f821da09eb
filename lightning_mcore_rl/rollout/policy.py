"""The trainer side of a rollout source: :class:`PolicyRollout` builds the recipe's
:class:`~lightning_mcore_rl.rollout.RolloutSource` once megatron's groups exist, refits it after
every optimizer step, and logs the train/inference mismatch extrema.

Shapes: ``B`` sequences, ``S`` tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mcore_rl.rollout.hf_source import HFRolloutSource
from lightning_mcore_rl.rollout.source import (
    MegatronRolloutSource,
    Rollout,
    RolloutSource,
    SamplingConfig,
)

if TYPE_CHECKING:
    from lightning_mcore_rl.module import MCoreRLModule
    from lightning_mcore_rl.recipes.common import RecipeModel
    from lightning_mcore_rl.strategy.strategy import MCoreRLStrategy

RolloutBackend = Literal["megatron", "hf"]
"""``"megatron"``: the embedded sampler on the training chunk (:class:`MegatronRolloutSource`);
``"hf"``: a ``transformers`` copy of an HF policy (:class:`HFRolloutSource`)."""


class PolicyRollout:
    """A recipe's rollout: the source of ``backend`` for ``policy``, refit whenever the policy
    has taken an optimizer step since the last refit (before the next :meth:`generate`, as NeMo
    RL refits a stale generation backend).

    The ``"hf"`` source's generator is the first rank of megatron's model-parallel group (TP x
    PP) of each data-parallel replica; the refit streams
    :meth:`~lightning_mcore_rl.models.HFBridge.export_hf_weights` (TP all-gather, PP broadcast)
    on every rank.

    Args:
        backend: which source.
        policy: the recipe's model; ``"hf"`` needs an ``HFModelSpec`` one.

    Raises:
        ValueError: ``backend="hf"`` with a policy that is not a Hugging Face checkpoint, or an
            unknown backend.
    """

    def __init__(self, backend: RolloutBackend, policy: RecipeModel) -> None:
        from lightning_mcore_rl.recipes.common import HFModelSpec

        if backend not in ("megatron", "hf"):
            raise ValueError(f"`backend` must be 'megatron' or 'hf', got {backend!r}.")
        if backend == "hf" and not isinstance(policy.spec, HFModelSpec):
            raise ValueError(
                "`backend='hf'` generates with a transformers copy of the policy and needs an "
                f"HFModelSpec model, got {type(policy.spec).__name__}; use backend='megatron'."
            )
        self.backend = backend
        self.policy = policy
        self.source: RolloutSource | None = None
        self.refit_step: int | None = None

    def build(self, strategy: MCoreRLStrategy) -> RolloutSource:
        """The source, built on first use (megatron's groups exist then)."""
        if self.source is not None:
            return self.source
        groups = strategy.groups
        if self.backend == "megatron":
            pp_group = groups.pp_group if groups.pp_size > 1 else None
            chunk = strategy.model_chunks[0]
            self.source = MegatronRolloutSource(chunk, groups.tp_group, pp_group)
            return self.source
        if groups.cp_size != 1:
            raise ValueError(
                f"backend='hf' shares a rollout over the model-parallel group (TP x PP); "
                f"context_parallel_size must be 1, got {groups.cp_size}."
            )
        from megatron.core import parallel_state as ps

        group = ps.get_model_parallel_group()
        self.source = HFRolloutSource(self.policy.hf_bridge().directory, group)
        return self.source

    def generate(
        self,
        module: MCoreRLModule,
        prompts: Tensor,
        sampling: SamplingConfig,
        prompt_lengths: Tensor | None = None,
    ) -> Rollout:
        """Refit the source if ``module`` has stepped since the last refit, then sample
        ``prompts [B, P]`` (left-padded to ``prompt_lengths [B]`` real tokens; collective over
        the training world when refitting, over the source's group otherwise)."""
        strategy = module.mcore_strategy
        source = self.build(strategy)
        if source.refit_required and self.refit_step != module.global_step:
            bridge = self.policy.hf_bridge()
            source.update_weights(
                bridge.export_hf_weights(strategy.model_chunks, dtype=torch.float32)
            )
            self.refit_step = module.global_step
        return source.generate(prompts, sampling, prompt_lengths)


def mismatch_extrema(batch: Mapping[str, Any], dp_group: Any) -> dict[str, Tensor]:
    """Extremes of the per-token train/inference probability ratio
    ``exp(prev_logprobs - generation_logprobs)`` over the ``token_mask`` tokens of all
    data-parallel ranks (``1`` for both when the source and the trainer agree exactly; the means
    are ``ClippedPGLossFn``'s ``token_mult_prob_error`` and ``gen_kl_error``).

    Args:
        batch: ``generation_logprobs`` (the source's, 0 at prompt positions), ``prev_logprobs``
            (the trainer's ``compute_logprobs`` of the same tokens) and ``token_mask``, each
            ``[B, S]``.
        dp_group: the data-parallel group (one MIN and one MAX all-reduce).

    Returns:
        ``{"gen_train_ratio_min": [], "gen_train_ratio_max": []}``.
    """
    gen, prev, mask = (batch[k] for k in ("generation_logprobs", "prev_logprobs", "token_mask"))
    if not gen.shape == prev.shape == mask.shape:
        raise ValueError(
            f"`generation_logprobs` {tuple(gen.shape)}, `prev_logprobs` {tuple(prev.shape)} and "
            f"`token_mask` {tuple(mask.shape)} must be the same [B, S] shape."
        )
    ratio = torch.exp(prev.double() - gen.double())[mask.bool()]
    empty = ratio.numel() == 0
    low = torch.tensor(torch.inf, dtype=torch.float64) if empty else ratio.min()
    high = torch.tensor(-torch.inf, dtype=torch.float64) if empty else ratio.max()
    dist.all_reduce(low, op=dist.ReduceOp.MIN, group=dp_group)
    dist.all_reduce(high, op=dist.ReduceOp.MAX, group=dp_group)
    return {"gen_train_ratio_min": low.float(), "gen_train_ratio_max": high.float()}
