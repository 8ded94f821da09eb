"""PPO with a value model on the embedded toy task: GRPO's rollout loop, GAE advantages from a
learned value model instead of group baselines, and a clipped value loss."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import Any, cast

import torch
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from lightning_mcore_rl.algorithms import gae_advantages, masked_whiten, terminal_token_rewards
from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import (
    ClippedPGLossConfig,
    ClippedPGLossFn,
    LossInputType,
    LossType,
    MetricNormalizer,
    MseValueLossConfig,
    MseValueLossFn,
    calculate_kl,
    prepare_loss_input,
)
from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.parallel import unwrap_model
from lightning_mcore_rl.recipes.common import DEFAULT_TASK, HFModelSpec, TinyGPTSpec
from lightning_mcore_rl.recipes.grpo import (
    DEFAULT_GRPO_LOSS,
    DEFAULT_MODEL,
    DEFAULT_ROLLOUT,
    GRPOModule,
    ReferenceModel,
    RolloutSpec,
)
from lightning_mcore_rl.rollout import ModularCountingTask

DEFAULT_VALUE_LOSS = MseValueLossConfig(cliprange=0.2)
"""``PPOModule``'s default value loss: PPO's value clipping at 0.2 around the old values."""


# The value model is a second GPT trunk (the policy's architecture and initial weights, its final
# hidden states into a zero-initialised scalar head H -> 1) inside the SAME megatron chunk as the
# policy: the strategy has one model and one optimizer, so both trunks are trained by one step on
# L_pg + vf_coef * L_value. Their parameters are disjoint, so each gets the gradient of its own
# loss only and Adam updates them independently; they share the learning rate and the global
# gradient-norm clipping.
class PolicyValueChunk(MegatronModule):
    """A policy GPT and a value GPT (same config) with a scalar head, as one megatron chunk: the
    policy's logits ``[B, S, V/TP]``, with `emit_values` ``[B, S, V/TP + 1]``."""

    def __init__(self, policy: torch.nn.Module, value: torch.nn.Module) -> None:
        config = cast(Any, policy).config
        super().__init__(config=config)
        self.policy = policy
        self.value_trunk = value
        head = torch.nn.Linear(config.hidden_size, 1, dtype=config.params_dtype)
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
        self.value_head = head
        trunk = cast(Any, value)
        # the value trunk's final hidden states feed the head, so its vocabulary output layer is
        # frozen unless tied to the embedding
        if not trunk.share_embeddings_and_output_weights:
            trunk.output_layer.weight.requires_grad_(False)  # bypassed: never used
        for name in ("pre_process", "post_process", "model_type"):  # megatron reads them
            setattr(self, name, getattr(policy, name))
        self.emit_values = False

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Megatron's schedule hook (the chunk is the whole model: no pipeline input)."""
        cast(Any, self.policy).set_input_tensor(input_tensor)

    def values(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Any) -> Tensor:
        """Raw value-head outputs ``[B, S]``: entry ``t`` scores the prefix ``tokens[:t+1]``."""
        from lightning_mcore_rl.train.fused import lm_head_returns_hidden

        with lm_head_returns_hidden(self.value_trunk):
            hidden = self.value_trunk(input_ids, position_ids, attention_mask)  # [B, S, H]
        return cast(Tensor, self.value_head(hidden)).squeeze(-1)

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, attention_mask: Any, **kwargs: Any
    ) -> Tensor:
        """Policy logits ``[B, S, V/TP]``, or with `emit_values` ``[B, S, V/TP + 1]``."""
        # by default a plain GPT to the sampler, compute_logprobs and the reference swap
        logits = cast(Tensor, self.policy(input_ids, position_ids, attention_mask, **kwargs))
        if not self.emit_values:
            return logits
        values = self.values(input_ids, position_ids, attention_mask)
        # one tensor, because megatron's schedule hands the loss one output
        return torch.cat([logits, values.unsqueeze(-1).to(logits.dtype)], dim=-1)


def shift_values(raw: Tensor) -> Tensor:
    """Right-shift raw values ``[B, S]``: ``out[:, t] = raw[:, t-1]``, ``out[:, 0] = 0``."""
    # raw[:, t] scores the prefix tokens[:t+1]; shifted, out[:, t] is the state before token t
    return torch.cat([torch.zeros_like(raw[:, :1]), raw[:, :-1]], dim=1)


def prepare_policy_value_input(
    output: Tensor,
    data: BatchedDataDict,
    loss_fn: PPOLossFn,
    vocab_parallel_rank: int | None,
    vocab_parallel_group: Any,
    context_parallel_group: Any,
    *,
    sampling_params: TrainingSamplingParams | None = None,
    chunk_size: int | None = None,
) -> tuple[dict[str, Any], BatchedDataDict]:
    """The ``LossPostProcessor`` ``prepare_fn`` of `PPOLossFn`: the chunk's ``[B, S, V/TP + 1]``
    output into the policy loss's inputs (``next_token_logprobs [B, S-1]``, ...) and
    ``values [B, S]`` (right-shifted)."""
    logits, raw = output[..., :-1], output[..., -1]
    # the forward step divided the whole output by the temperature in place: undo it for values
    if sampling_params is not None and sampling_params.temperature != 1.0:
        raw = raw * sampling_params.temperature
    policy_input, data = prepare_loss_input(
        logits, data, cast(Any, loss_fn.policy_loss), vocab_parallel_rank, vocab_parallel_group,
        context_parallel_group, sampling_params=sampling_params, chunk_size=chunk_size,
    )  # fmt: skip
    return {**policy_input, "values": shift_values(raw)}, data


class PPOLossFn:
    """``L = L_pg + vf_coef * L_value``: `ClippedPGLossFn` on the policy logprobs and
    `MseValueLossFn` on ``values [B, S]``; metrics ``loss`` (the total), ``policy_loss``,
    ``value_loss`` and both losses' own."""

    input_type = LossInputType.LOGIT
    loss_type = LossType.TOKEN_LEVEL

    def __init__(
        self, policy_loss: ClippedPGLossFn, value_loss: MseValueLossFn, vf_coef: float = 1.0
    ) -> None:
        if vf_coef <= 0:
            raise ValueError(f"`vf_coef` must be > 0, got {vf_coef}.")
        self.policy_loss = policy_loss
        self.value_loss = value_loss
        self.vf_coef = vf_coef
        self.loss_type = policy_loss.loss_type
        # the policy loss's `loss` and sample count stand for the total's
        value_norms = {
            k: v
            for k, v in value_loss.metric_normalizations.items()
            if k not in ("loss", "num_valid_samples")
        }
        self.metric_normalizations: dict[str, MetricNormalizer] = {
            **policy_loss.metric_normalizations,
            **value_norms,
            "policy_loss": policy_loss.metric_normalizations["loss"],
            "value_loss": MetricNormalizer.TOKENS,
        }

    @property
    def input_keys(self) -> tuple[str, ...]:
        """The union of both losses' ``input_keys``."""
        return tuple(dict.fromkeys((*self.policy_loss.input_keys, *self.value_loss.input_keys)))

    def __call__(
        self,
        data: Mapping[str, Any],
        global_valid_seqs: Tensor | float,
        global_valid_toks: Tensor | float,
        *,
        next_token_logprobs: Tensor,
        values: Tensor,
        entropy: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The microbatch's share of both global losses and their metrics."""
        pg, pg_metrics = self.policy_loss(
            data, global_valid_seqs, global_valid_toks,
            next_token_logprobs=next_token_logprobs, entropy=entropy,
        )  # fmt: skip
        vf, vf_metrics = self.value_loss(data, global_valid_seqs, global_valid_toks, logits=values)
        loss = pg + self.vf_coef * vf
        metrics = {**pg_metrics}
        metrics.update({k: v for k, v in vf_metrics.items() if k in self.metric_normalizations})
        metrics.update(loss=loss.detach(), policy_loss=pg.detach(), value_loss=vf.detach())
        return loss, metrics


class PPOModule(GRPOModule):
    """PPO (arXiv:1707.06347) with a learned value model and GAE, on `PromptDataModule` batches.

    Args:
        task: the rewarded task.
        model: the policy (`TinyGPTSpec` or `HFModelSpec`); the value model starts as its copy.
        rollout: sampling settings (``backend="megatron"``, ``max_staleness=0``, no top-k/top-p).
        loss: the policy's ``ClippedPGLossFn`` settings (a reference KL in loss or reward).
        value_loss: ``MseValueLossFn`` settings (default: value clipping 0.2).
        vf_coef: weight of the value loss in the combined loss.
        gae_gamma: GAE discount (NeMo RL's PPO default 1).
        gae_lambda: GAE lambda (NeMo RL's default 0.95).
        normalize_advantages: whiten the advantages over the global batch's completion tokens.
        lr: Adam learning rate of both trunks and the head.
        pass_at_k: validation ``val_pass@k``.
        reference_model: the reference policy with a KL (as `GRPOModule`'s)."""

    def __init__(
        self,
        task: ModularCountingTask | None = DEFAULT_TASK,
        model: TinyGPTSpec | HFModelSpec | None = DEFAULT_MODEL,
        rollout: RolloutSpec | None = DEFAULT_ROLLOUT,
        loss: ClippedPGLossConfig | None = DEFAULT_GRPO_LOSS,
        value_loss: MseValueLossConfig | None = DEFAULT_VALUE_LOSS,
        vf_coef: float = 1.0,
        gae_gamma: float = 1.0,
        gae_lambda: float = 0.95,
        normalize_advantages: bool = True,
        lr: float = 5e-3,
        pass_at_k: tuple[int, ...] = (1,),
        reference_model: ReferenceModel = "recompute",
    ) -> None:
        # any TP/DP; PP = CP = 1 and no sequence parallelism (checked in build_chunk)
        for name, value in (("gae_gamma", gae_gamma), ("gae_lambda", gae_lambda)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"`{name}` must be in [0, 1], got {value}.")
        # the HF backend's refit exports a plain GPT chunk, not the policy + value chunk
        if rollout is not None and rollout.backend != "megatron":
            raise ValueError(
                f"PPOModule samples with the embedded sampler only: `rollout.backend` must be "
                f"'megatron', got {rollout.backend!r} (the HF backend's refit exports a plain "
                "GPT chunk, not the policy + value chunk)."
            )
        if rollout is not None:
            rollout.check_synchronous("PPOModule")
        super().__init__(task, model, rollout, loss, lr, pass_at_k, reference_model=reference_model)
        # replaces GRPO's loss; the policy part keeps GRPO's loss config
        self.loss_fn = PPOLossFn(
            ClippedPGLossFn(self.loss_config), MseValueLossFn(value_loss), vf_coef
        )
        self.gae_gamma = gae_gamma
        self.gae_lambda = gae_lambda
        self.normalize_advantages = normalize_advantages

    def _check_kl_in_reward(self, loss: ClippedPGLossConfig, estimator: str) -> None:
        """PPO folds the KL into GAE's token rewards: every setting is valid."""

    def _advantages_need_logprobs(self) -> bool:
        """GAE needs the old values (and with a reward KL the logprobs): always deferred."""
        return True

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        """A `PolicyValueChunk` of two chunks built like GRPO's policy.

        Raises:
            ValueError: PP, CP or SP, fused linear logprobs or sequence packing (at model build)."""
        strategy = self.mcore_strategy
        cfg = strategy.policy_config()
        # the values are a column of the chunk's unpacked full output
        if strategy.use_fused_linear_logprobs or cfg.sequence_packing:
            raise ValueError(
                "PPOModule needs `MCoreRLStrategy(logprobs=LogprobKernelConfig("
                "use_fused_linear_logprobs=False))` and "
                f"`sequence_packing=False` (got {strategy.use_fused_linear_logprobs} and "
                f"{cfg.sequence_packing}): the values are a column of the chunk's unpacked output."
            )
        policy = self.policy.build_chunk(self, vp_stage)
        config = cast(Any, policy).config
        # the old values come from a direct call of the whole chunk
        for name in ("pipeline_model_parallel_size", "context_parallel_size"):
            if getattr(config, name) != 1:
                raise ValueError(
                    f"PPOModule runs the policy + value chunk unpipelined and unsharded (the "
                    f"old values come from a direct call of the whole chunk): {name} must be 1, "
                    f"got {getattr(config, name)}."
                )
        # the embedded sampler's limit
        if config.sequence_parallel:
            raise ValueError(
                "PPOModule does not support sequence_parallel=True (the embedded sampler's "
                "limit); set MCoreRLStrategy(sequence_parallel=False)."
            )
        return PolicyValueChunk(policy, self.policy.build_chunk(self, vp_stage))

    def loss_post_processor(self, num_microbatches: int | None = None) -> Any:
        """The loss callback with `prepare_policy_value_input`."""
        from lightning_mcore_rl.train import LossPostProcessor

        cfg = self.mcore_strategy.policy_config()
        prepare = functools.partial(
            prepare_policy_value_input,
            sampling_params=self.sampling_params(),
            chunk_size=cfg.logprob_chunk_size,
        )
        return LossPostProcessor(
            cast(Any, self.loss_fn), cfg, num_microbatches,
            sampling_params=self.sampling_params(), prepare_fn=prepare,
        )  # fmt: skip

    def _chunks(self) -> list[PolicyValueChunk]:
        return [cast(PolicyValueChunk, unwrap_model(c)) for c in self.mcore_strategy.model_chunks]

    @contextlib.contextmanager
    def reference_weights(self) -> Iterator[None]:
        """The initial weights in the policy trunk (the value model keeps its own)."""
        # the recompute path swaps the policy trunk only
        trunks = [chunk.policy for chunk in self._chunks()]
        with self.policy.initial_weights(trunks, self.parallel_groups):
            yield

    @contextlib.contextmanager
    def emitting_values(self) -> Iterator[None]:
        """The chunks return policy logits and values (restored on exit, also on error)."""
        chunks = self._chunks()
        for chunk in chunks:
            chunk.emit_values = True
        try:
            yield
        finally:
            for chunk in chunks:
                chunk.emit_values = False

    @torch.no_grad()
    def compute_values(self, batch: Mapping[str, Any]) -> Tensor:
        """The value model's right-shifted values ``[B, S]`` of this rank's batch (forward-only)."""
        # the whole rows at once, on the one unpipelined chunk
        ids = cast(Tensor, batch["input_ids"])
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        raw = self._chunks()[0].values(ids, positions, None)
        return shift_values(raw.float())

    def gae(self, rewards: Tensor, batch: Mapping[str, Any]) -> tuple[Tensor, Tensor]:
        """GAE ``(advantages, returns)`` ``[b*G, S]`` from the rewards ``[b*G]`` and the batch's
        ``token_mask``, ``values`` (and with ``use_kl_in_reward`` its logprobs)."""
        cfg = self.loss_config
        mask = cast(Tensor, batch["token_mask"])
        kl = None
        if cfg.use_kl_in_reward and self.kl_penalty > 0:
            kl = calculate_kl(
                batch["prev_logprobs"], batch["reference_policy_logprobs"],
                cfg.reference_policy_kl_type, cfg.kl_input_clamp_value, cfg.kl_output_clamp_value,
            )  # fmt: skip
        # NeMo RL's GAE semantics: the terminal reward minus the per-token reference KL (with
        # use_kl_in_reward); the loss's KL term stays as configured
        token_rewards = terminal_token_rewards(rewards, mask, kl, self.kl_penalty)
        advantages, returns = gae_advantages(
            token_rewards, batch["values"], mask, self.gae_gamma, self.gae_lambda
        )
        # unbiased variance over the DP group: NeMo RL's normalize_advantages
        if self.normalize_advantages:
            group = self.mcore_strategy.groups.dp_group
            advantages = masked_whiten(advantages, mask, unbiased=True, group=group) * mask
        return advantages, returns

    def advantages(self, rewards: Tensor, batch: Mapping[str, Any]) -> Tensor:
        """GAE advantages ``[b*G, S]``; puts the old ``values`` and ``returns`` into ``batch``."""
        # GRPO's training step calls this after the logprobs (`_advantages_need_logprobs`)
        data = cast(dict[str, Any], batch)  # the step's own BatchedDataDict
        data["values"] = self.compute_values(batch)
        advantages, data["returns"] = self.gae(rewards, batch)
        return advantages

    def forward_backward(self, batch: Mapping[str, Any], forward_only: bool = False) -> Any:
        """The strategy's step with the chunks emitting policy logits and values."""
        with self.emitting_values():
            return super().forward_backward(batch, forward_only=forward_only)
