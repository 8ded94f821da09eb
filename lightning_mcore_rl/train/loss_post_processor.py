"""``LossPostProcessor``: the per-microbatch training-loss callback (docs/behaviour-reference.md §2.5)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import (
    DraftLossWrapper,
    LossFunction,
    LossInputType,
    NLLLossFn,
    SequencePackingFusionLossWrapper,
    SequencePackingLossWrapper,
    prepare_loss_input,
    prepare_packed_loss_input,
    wrap_loss_fn_with_input_preparation,
)
from lightning_mcore_rl.ops import (
    TrainingSamplingParams,
)
from lightning_mcore_rl.parallel import ParallelGroups, resolve_groups
from lightning_mcore_rl.train.binding import Binding
from lightning_mcore_rl.train.cp_layout import OutputProcessor
from lightning_mcore_rl.train.fused import (
    FUSED_NEEDS_LOGITS,
    FusedLMHead,
    ValidCounts,
    fused_packed_prepare_fn,
    fused_prepare_fn,
    reject_filtering,
)
from lightning_mcore_rl.train.policy_config import PolicyConfig, load_policy_config


class LossPostProcessor:
    """Per-microbatch loss callback for megatron's schedule (docs/behaviour-reference.md §2.5).

    Args:
        loss_fn: the loss function to wrap.
        cfg: `PolicyConfig` or NeMo RL's policy mapping (packing, chunk size, draft).
        num_microbatches: `M` (`None`, the hooks' default: the pass's, bound per microbatch).
        cp_normalize: divide the loss by the context-parallel size (`scale_loss`).
        sampling_params: top-k/top-p for logprob losses (the temperature is applied upstream).
        draft_model: the EAGLE draft trained in this pass (its `eagle_module.d2t` vocab map).
        prepare_fn: override of `prepare_loss_input` (same signature), e.g. a value model's.
        defer_draft_normalization: the draft term and metrics are raw sums, divided at the end.
        teacher_output_layer_weight_by_index: this rank's teacher LM-head shards `[V_l, H_t]`.
        use_fused_linear_logprobs: the model output is the last stage's final hidden states.

    Raises:
        ValueError: `use_fused_linear_logprobs` with a loss that needs logits (not
            `LossInputType.LOGPROB`), a custom `prepare_fn`, a draft model or top-k/top-p;
            `num_microbatches` < 1.
    """

    trains = True
    needs_full_logits = False
    captures_hidden_states = False

    def __init__(
        self,
        loss_fn: LossFunction,
        cfg: PolicyConfig | Mapping[str, Any] | None,
        num_microbatches: int | None = None,
        cp_normalize: bool = True,
        sampling_params: TrainingSamplingParams | None = None,
        draft_model: Any = None,
        prepare_fn: Callable[..., Any] | None = None,
        defer_draft_normalization: bool = False,
        teacher_output_layer_weight_by_index: dict[int, Tensor] | None = None,
        use_fused_linear_logprobs: bool = False,
    ) -> None:
        if use_fused_linear_logprobs:
            _check_fused_loss(loss_fn, prepare_fn, draft_model, sampling_params)
        if num_microbatches is not None and num_microbatches < 1:
            raise ValueError(f"`num_microbatches` must be >= 1, got {num_microbatches}")
        self.loss_fn = loss_fn
        self.cfg = load_policy_config(cfg)
        self.num_microbatches = num_microbatches
        self.cp_normalize = cp_normalize
        self.sampling_params = sampling_params
        self.draft_model = draft_model
        # whether the draft term is added is decided per microbatch by `student_logits` in the
        # data (the draft extension puts them there); deferred: the step divides the draft's
        # gradients and metrics once by the global token count at its end
        # (eagle_draft.finish_draft_gradients), else each microbatch divides by
        # global_valid_toks: both give the same update
        self.defer_draft_normalization = defer_draft_normalization
        self.d2t = getattr(getattr(draft_model, "eagle_module", None), "d2t", None)
        self.prepare_fn = prepare_fn
        self.teacher_output_layer_weight_by_index = teacher_output_layer_weight_by_index
        # fused: the LOGPROB loss input comes from hidden x output weight (the lm_head the
        # forward step binds), never from [tokens, V_l] logits; packed rows run one kernel call
        # per microbatch (the fuse_loss form, same result); with cfg.fused_gradient_in_forward a
        # loss declaring token_local_gradient (no entropy, CP = 1) has the head's gradients
        # computed in the forward (fused.fused_prepare_fn): nothing is recomputed
        self.use_fused_linear_logprobs = use_fused_linear_logprobs

    @property
    def model_dtype_exact(self) -> bool:
        """Whether logits kept in the model dtype give this pass's fp32 result: one chunked
        kernel reads them (no custom ``prepare_fn``, no draft vocabulary map)."""
        from lightning_mcore_rl.train.logits_dtype import one_kernel_consumer

        return self.prepare_fn is None and self.d2t is None and one_kernel_consumer(self.loss_fn)

    def bind(self, b: Binding) -> OutputProcessor:
        """The forward step's call: `__call__` with the microbatch's fields."""
        return self(
            b.data_dict, b.packed_seq_params, b.global_valid_seqs, b.global_valid_toks,
            lm_head=b.lm_head, groups=b.groups, num_microbatches=b.num_microbatches,
        )  # fmt: skip

    def scale_loss(self, loss: Tensor, cp_size: int, num_microbatches: int | None = None) -> Tensor:
        """`R = L * M / CP^2` (`cp_normalize`) or `L * M / CP` for the microbatch's loss `L`
        (`num_microbatches`: the pass's `M`, `None`: the built one): the one place of this
        scaling; a new tensor (the schedule divides it in place).

        Raises:
            ValueError: no `M` (neither built with one nor given), or two different ones.
        """
        # docs/behaviour-reference.md 2.5, trap 5: megatron's schedule multiplies a 2-tuple loss
        # by CP and divides it by M before backward, so it back-propagates R * CP / M = L / CP.
        # calculate_per_token_loss=True with average_in_collective=False makes DDP sum gradients
        # over DP x CP without rescaling (the 2-tuple path reports 0 tokens). Every CP rank
        # computes the same full-sequence L (logprobs are all-gathered over CP) and the gather's
        # backward sums the CP ranks' gradients: each rank's local-logit gradient is
        # CP * d(L / CP) / dz_local = dL / dz_local, exact. L is normalised by the global valid
        # counts already, so summing over microbatches and DP ranks gives the gradient of the
        # global mean; nothing else may average.
        m = self._microbatches(num_microbatches)
        if self.cp_normalize:
            loss = loss / cp_size
        return loss * m / cp_size

    def _microbatches(self, num_microbatches: int | None) -> int:
        own = self.num_microbatches
        if own is not None and num_microbatches is not None and own != num_microbatches:
            raise ValueError(
                f"LossPostProcessor was built with num_microbatches={own} but the pass runs "
                f"{num_microbatches} microbatches; build it without `num_microbatches` (the "
                "step binds its own) or with the pass's."
            )
        m = own if own is not None else num_microbatches
        if m is None:
            raise ValueError(
                "LossPostProcessor needs the pass's `num_microbatches`: build it with one or "
                "run it through megatron_forward_backward, which binds it per microbatch."
            )
        return m

    def _bound_prepare_fn(
        self, lm_head: FusedLMHead | None, valid_counts: ValidCounts | None = None
    ) -> Callable[..., Any]:
        """The loss input's preparation; ``valid_counts``: the fused head may compute its
        gradients in the forward (only where the prepared call is the microbatch's one kernel
        call)."""
        if lm_head is not None:
            return fused_prepare_fn(lm_head, self.cfg.logprob_chunk_size, valid_counts)
        if self.prepare_fn is not None:
            return self.prepare_fn
        return functools.partial(
            prepare_loss_input, sampling_params=self.sampling_params, d2t=self.d2t,
            chunk_size=self.cfg.logprob_chunk_size,
            teacher_output_layer_weight_by_index=self.teacher_output_layer_weight_by_index,
        )  # fmt: skip

    def _wrapper(
        self,
        data_dict: BatchedDataDict,
        packed_seq_params: Any,
        groups: ParallelGroups,
        lm_head: FusedLMHead | None,
        valid_counts: ValidCounts | None,
    ) -> Any:
        wrapper = self._policy_wrapper(data_dict, packed_seq_params, groups, lm_head, valid_counts)
        if "student_logits" not in data_dict:
            return wrapper
        from lightning_mcore_rl.extensions.eagle_draft import draft_prepare_fn

        packed = self.cfg.sequence_packing and packed_seq_params is not None
        return DraftLossWrapper(
            wrapper,
            draft_prepare_fn(
                self._bound_prepare_fn(lm_head),
                packed_seq_params.cu_seqlens_q_padded if packed else None,
            ),
            data_dict,
            self.cfg.draft_loss_weight,
            groups.tp_rank, groups.tp_group, groups.cp_group,
            draft_valid_toks=1.0 if self.defer_draft_normalization else None,
        )  # fmt: skip

    def _policy_wrapper(
        self,
        data_dict: BatchedDataDict,
        packed_seq_params: Any,
        groups: ParallelGroups,
        lm_head: FusedLMHead | None,
        valid_counts: ValidCounts | None,
    ) -> Any:
        group_args = (groups.tp_rank, groups.tp_group, groups.cp_group)
        if self.cfg.sequence_packing and packed_seq_params is not None:
            cu = (packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded)
            # the fused head runs one kernel call per packed row whatever `fuse_loss` says: per
            # sequence it would save no logits, and it would lose the gradient in the forward
            if self.cfg.fuse_loss or lm_head is not None:
                if self.prepare_fn is not None:
                    raise ValueError("`fuse_loss=True` cannot use a custom `prepare_fn`")
                fused_prepare = functools.partial(
                    prepare_packed_loss_input, sampling_params=self.sampling_params,
                    chunk_size=self.cfg.logprob_chunk_size,
                ) if lm_head is None else fused_packed_prepare_fn(
                    lm_head, self.cfg.logprob_chunk_size, valid_counts
                )  # fmt: skip
                return SequencePackingFusionLossWrapper(
                    self.loss_fn, fused_prepare, *cu, *group_args
                )
            if hasattr(self.loss_fn, "split_output_tensor"):
                raise ValueError(
                    f"`{type(self.loss_fn).__name__}` scores chosen/rejected pairs, which the "
                    "per-sequence packed loss would split into single rows; build the "
                    "LossPostProcessor with `PolicyConfig(sequence_packing=True, fuse_loss=True)` "
                    "(one loss call per packed microbatch, as `recipes.DPOModule` does) or turn "
                    "`sequence_packing` off"
                )
            return SequencePackingLossWrapper(
                self.loss_fn, self._bound_prepare_fn(None), *cu, *group_args
            )
        prepare_fn = self._bound_prepare_fn(lm_head, valid_counts)
        return functools.partial(
            wrap_loss_fn_with_input_preparation, loss_fn=self.loss_fn, prepare_fn=prepare_fn,
            vocab_parallel_rank=groups.tp_rank, vocab_parallel_group=groups.tp_group,
            context_parallel_group=groups.cp_group,
        )  # fmt: skip

    def _direct_packed_sft(self, prepacked_loss_mask: Tensor) -> Any:
        if not isinstance(self.loss_fn, NLLLossFn):
            raise TypeError(
                f"direct Megatron-LM prepacked SFT requires the loss function to be NLLLossFn, "
                f"got {type(self.loss_fn).__name__}"
            )

        def per_token_loss(
            output: Tensor, data: BatchedDataDict, _gvs: Any, gvt: Tensor
        ) -> tuple[Tensor, dict[str, Any]]:
            if output.shape != prepacked_loss_mask.shape:
                raise ValueError(
                    f"loss and loss mask shapes must match: {tuple(output.shape)} vs "
                    f"{tuple(prepacked_loss_mask.shape)}"
                )
            loss = (output.float() * prepacked_loss_mask).sum() / gvt
            valid = torch.as_tensor(data["sample_mask"]).sum()
            return loss, {"loss": loss.detach().clone(), "num_valid_samples": valid.detach()}

        return per_token_loss

    def __call__(
        self,
        data_dict: BatchedDataDict,
        packed_seq_params: Any = None,
        global_valid_seqs: Tensor | None = None,
        global_valid_toks: Tensor | None = None,
        prepacked_loss_mask: Tensor | None = None,
        lm_head: FusedLMHead | None = None,
        *,
        groups: ParallelGroups | None = None,
        num_microbatches: int | None = None,
    ) -> OutputProcessor:
        """Bind one microbatch `data_dict [B, S, ...]` -> `f(output) -> (scaled_loss, metrics)`
        (the loss function's metrics, unscaled).

        Args:
            prepacked_loss_mask: `[1, T/CP]` mask when the model returned per-token losses
                (direct prepacked SFT; the loss is then CP-local).
            lm_head: output weight and temperature (fused path, last stage), else `None`.
            groups: this rank's groups (`None`: megatron's initialised state).

        Raises:
            ValueError: see `scale_loss` (raised here, before the forward's output).
        """
        groups = resolve_groups(groups)  # the seed API's callers pass none
        m = self._microbatches(num_microbatches)
        if prepacked_loss_mask is not None:
            wrapper = self._direct_packed_sft(prepacked_loss_mask)
        else:
            valid_counts = None  # the fused head's gradient in the forward needs them
            if self.cfg.fused_gradient_in_forward:
                valid_counts = (global_valid_seqs, global_valid_toks)
            wrapper = self._wrapper(data_dict, packed_seq_params, groups, lm_head, valid_counts)
        fused = self.use_fused_linear_logprobs and prepacked_loss_mask is None

        def loss_and_metrics(output_tensor: Tensor) -> tuple[Tensor, dict[str, Any]]:
            if fused and lm_head is None:  # only the last stage calls this, with its lm_head
                raise RuntimeError(
                    "LossPostProcessor(use_fused_linear_logprobs=True) needs the `lm_head` that "
                    "forward_with_post_processing_fn(use_fused_linear_logprobs=True) binds"
                )
            loss, metrics = wrapper(output_tensor, data_dict, global_valid_seqs, global_valid_toks)
            return self.scale_loss(loss, groups.cp_size, m), metrics

        return loss_and_metrics


def _check_fused_loss(
    loss_fn: LossFunction,
    prepare_fn: Callable[..., Any] | None,
    draft_model: Any,
    sampling_params: TrainingSamplingParams | None,
) -> None:
    """What the fused path cannot serve: everything that needs the ``[tokens, V_l]`` logits."""
    if loss_fn.input_type is not LossInputType.LOGPROB:
        raise ValueError(
            FUSED_NEEDS_LOGITS.format(
                what=f"{type(loss_fn).__name__} (loss input {loss_fn.input_type!r})"
            )
        )
    if prepare_fn is not None:
        raise ValueError(FUSED_NEEDS_LOGITS.format(what="a custom `prepare_fn`"))
    if draft_model is not None:
        raise ValueError(FUSED_NEEDS_LOGITS.format(what="an EAGLE `draft_model`"))
    reject_filtering(sampling_params, "LossPostProcessor")
