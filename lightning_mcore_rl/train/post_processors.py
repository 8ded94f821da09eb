"""Post-processors: turn one microbatch's model output into ``(loss, metrics)`` for Megatron.

Each post-processor is called per microbatch with the microbatch's metadata and returns the
callable Megatron's schedule applies to the last pipeline stage's output. Process groups are read
from Megatron's ``parallel_state`` here, at the boundary, and passed explicitly into the losses
and ops.

Shapes: ``B`` sequences, ``S`` width of the unpacked batch, ``T`` packed tokens, ``V_l = V/TP``,
``k`` top-k entries, ``D`` teacher payload width. Model output: ``[B, S/CP, V_l]`` (padded) or
``[1, T/CP, V_l]`` (packed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import (
    DraftLossWrapper,
    LossFunction,
    NLLLossFn,
    SequencePackingFusionLossWrapper,
    SequencePackingLossWrapper,
    prepare_loss_input,
    prepare_packed_loss_input,
    wrap_loss_fn_with_input_preparation,
)
from lightning_mcore_rl.losses.loss_input import mask_out_neg_inf_logprobs
from lightning_mcore_rl.ops import (
    TrainingSamplingParams,
    allgather_cp_sharded_tensor,
    distributed_vocab_topk,
    from_parallel_logits_to_logprobs,
    from_parallel_logits_to_logprobs_packed_sequences,
)
from lightning_mcore_rl.train.config import PolicyConfig, load_policy_config

OutputProcessor = Callable[[Tensor], tuple[Tensor, dict[str, Any]]]
CP_NEEDS_PACKING = "Context Parallelism (CP>1) requires sequence packing to be enabled."


class _Groups(NamedTuple):
    tp_group: Any
    tp_rank: int
    cp_group: Any
    cp_size: int


def _megatron_groups() -> _Groups:
    from megatron.core import parallel_state as ps

    return _Groups(
        ps.get_tensor_model_parallel_group(),
        ps.get_tensor_model_parallel_rank(),
        ps.get_context_parallel_group(),
        ps.get_context_parallel_world_size(),
    )


def _vocab_range(output: Tensor, tp_rank: int) -> tuple[int, int]:
    local_vocab = output.shape[-1]
    return tp_rank * local_vocab, (tp_rank + 1) * local_vocab


def _host_ints(values: Tensor | Sequence[int]) -> list[int]:
    return [int(v) for v in (values.tolist() if torch.is_tensor(values) else values)]


def _gather_packed_over_cp(local: Tensor, cu: list[int], cp_group: Any) -> Tensor:
    """``[1, T/CP, ...]`` per-span zigzag shards -> ``[1, T, ...]``, one all-gather per span."""
    cp_size = cp_group.size()
    full = local.new_zeros(1, cu[-1], *local.shape[2:])
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        if end > start:  # per sequence: gathering the whole row misplaces tokens (trap 3)
            span = local[:, start // cp_size : end // cp_size]
            full[:, start:end] = allgather_cp_sharded_tensor(span, cp_group, seq_dim=1)
    return full


def _unpack_rows(full: Tensor, cu: list[int], lengths: Tensor, width: int) -> Tensor:
    """``[1, T, ...]`` -> ``[B, S, ...]`` zeros + row ``i``'s first ``min(len_i, S)`` tokens."""
    lens = _host_ints(lengths)
    out = full.new_zeros(len(lens), width, *full.shape[2:])
    for i, length in enumerate(lens):
        n = min(length, width)
        out[i, :n] = full[0, cu[i] : cu[i] + n]
    return out


class LossPostProcessor:
    """Per-microbatch loss callback for Megatron's schedule (spec §2.5).

    Args:
        loss_fn: Loss function to wrap.
        cfg: :class:`PolicyConfig` or NeMo RL's policy mapping (packing, chunk size, draft).
        num_microbatches: ``M``, used to counteract Megatron's per-microbatch loss averaging.
        cp_normalize: Divide the loss by the context-parallel size (see :meth:`scale_loss`).
        sampling_params: Top-k/top-p for logprob losses (temperature is applied upstream).
        draft_model: EAGLE draft model; only its ``eagle_module.d2t`` vocab map is read here.
        prepare_fn: Override of :func:`prepare_loss_input` (same call signature), e.g. a value
            model's right-shift.
        defer_draft_normalization: Not supported (raises): the split optimizer-step draft
            finalisation belongs to the draft-model trainer, which is not part of this project.
        teacher_output_layer_weight_by_index: This rank's teacher LM-head shards ``[V_l, H_t]``
            for full-vocabulary on-policy distillation, keyed by teacher index.
    """

    def __init__(
        self,
        loss_fn: LossFunction,
        cfg: PolicyConfig | Mapping[str, Any] | None,
        num_microbatches: int = 1,
        cp_normalize: bool = True,
        sampling_params: TrainingSamplingParams | None = None,
        draft_model: Any = None,
        prepare_fn: Callable[..., Any] | None = None,
        defer_draft_normalization: bool = False,
        teacher_output_layer_weight_by_index: dict[int, Tensor] | None = None,
    ) -> None:
        if num_microbatches < 1:
            raise ValueError(f"`num_microbatches` must be >= 1, got {num_microbatches}")
        if defer_draft_normalization:
            raise NotImplementedError(
                "`defer_draft_normalization=True` needs the draft-model trainer's split "
                "optimizer-step finalisation, which this project does not have"
            )
        self.loss_fn = loss_fn
        self.cfg = load_policy_config(cfg)
        self.num_microbatches = num_microbatches
        self.cp_normalize = cp_normalize
        self.sampling_params = sampling_params
        self.d2t = getattr(getattr(draft_model, "eagle_module", None), "d2t", None)
        self.prepare_fn = prepare_fn
        self.teacher_output_layer_weight_by_index = teacher_output_layer_weight_by_index

    def scale_loss(self, loss: Tensor, cp_size: int) -> Tensor:
        """``R = L * M / CP^2`` (``cp_normalize``) or ``L * M / CP``: the ONE place of this scaling.

        Derivation (spec §2.5, trap 5). Megatron's schedule multiplies a 2-tuple loss by ``CP``
        and divides it by ``M`` before backward, so it back-propagates ``R * CP / M = L / CP``.
        ``calculate_per_token_loss=True`` with ``average_in_collective=False`` makes DDP *sum*
        gradients over DP x CP without rescaling (the 2-tuple path reports 0 tokens). Every CP
        rank computes the same full-sequence ``L`` (logprobs are all-gathered over CP) and the
        gather's backward sums the CP ranks' gradients, so each rank's local-logit gradient is
        ``CP * d(L / CP) / dz_local = dL / dz_local``: exact. ``L`` is already normalised by the
        global valid counts, so summing over microbatches and DP ranks gives the gradient of
        the global mean; nothing else may average.

        Args:
            loss: ``L``, the loss function's scalar for this microbatch.
            cp_size: ``CP``.

        Returns:
            The scaled loss handed to Megatron (a new tensor: the schedule divides it in place).
        """
        if self.cp_normalize:
            loss = loss / cp_size
        return loss * self.num_microbatches / cp_size

    def _bound_prepare_fn(self) -> Callable[..., Any]:
        if self.prepare_fn is not None:
            return self.prepare_fn
        return functools.partial(
            prepare_loss_input, sampling_params=self.sampling_params, d2t=self.d2t,
            chunk_size=self.cfg.logprob_chunk_size,
            teacher_output_layer_weight_by_index=self.teacher_output_layer_weight_by_index,
        )  # fmt: skip

    def _wrapper(self, data_dict: BatchedDataDict, packed_seq_params: Any, groups: _Groups) -> Any:
        prepare_fn = self._bound_prepare_fn()
        group_args = (groups.tp_rank, groups.tp_group, groups.cp_group)
        if self.cfg.sequence_packing and packed_seq_params is not None:
            if "student_logits" in data_dict:
                raise NotImplementedError("draft-model losses do not support sequence packing")
            cu = (packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded)
            if self.cfg.fuse_loss:
                if self.prepare_fn is not None:
                    raise ValueError("`fuse_loss=True` cannot use a custom `prepare_fn`")
                fused_prepare = functools.partial(
                    prepare_packed_loss_input, sampling_params=self.sampling_params,
                    chunk_size=self.cfg.logprob_chunk_size,
                )  # fmt: skip
                return SequencePackingFusionLossWrapper(
                    self.loss_fn, fused_prepare, *cu, *group_args
                )
            return SequencePackingLossWrapper(self.loss_fn, prepare_fn, *cu, *group_args)
        wrapper = functools.partial(
            wrap_loss_fn_with_input_preparation, loss_fn=self.loss_fn, prepare_fn=prepare_fn,
            vocab_parallel_rank=groups.tp_rank, vocab_parallel_group=groups.tp_group,
            context_parallel_group=groups.cp_group,
        )  # fmt: skip
        if "student_logits" in data_dict:
            return DraftLossWrapper(
                wrapper, prepare_fn, self.cfg.draft_loss_weight, None, *group_args
            )
        return wrapper

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
    ) -> OutputProcessor:
        """Bind one microbatch: returns ``f(output) -> (scaled_loss, metrics)``.

        Args:
            data_dict: The microbatch ``[B, S, ...]``.
            packed_seq_params: Megatron ``PackedSeqParams`` when the microbatch is packed.
            global_valid_seqs: Valid sequences of the global batch.
            global_valid_toks: Valid (shifted) tokens of the global batch.
            prepacked_loss_mask: ``[1, T/CP]`` mask when the model returned per-token losses
                (direct prepacked SFT); the loss is then CP-local.

        Returns:
            The callable Megatron applies to the model output; metrics are the loss
            function's, unscaled.
        """
        groups = _megatron_groups()
        if prepacked_loss_mask is not None:
            wrapper = self._direct_packed_sft(prepacked_loss_mask)
        else:
            wrapper = self._wrapper(data_dict, packed_seq_params, groups)

        def loss_and_metrics(output_tensor: Tensor) -> tuple[Tensor, dict[str, Any]]:
            loss, metrics = wrapper(output_tensor, data_dict, global_valid_seqs, global_valid_toks)
            return self.scale_loss(loss, groups.cp_size), metrics

        return loss_and_metrics


class LogprobsPostProcessor:
    """Forward-only callback returning stored-convention token logprobs ``[B, S]`` (spec §2.6).

    Args:
        cfg: :class:`PolicyConfig` or NeMo RL's policy mapping.
        sampling_params: Top-k/top-p filtering (temperature is applied upstream).
        use_fused_linear_logprobs: The model output already holds next-token logprobs.
    """

    def __init__(
        self,
        cfg: PolicyConfig | Mapping[str, Any] | None,
        sampling_params: TrainingSamplingParams | None = None,
        use_fused_linear_logprobs: bool = False,
    ) -> None:
        self.cfg = load_policy_config(cfg)
        self.sampling_params = sampling_params
        self.use_fused_linear_logprobs = use_fused_linear_logprobs

    def _next_token(
        self, output: Tensor, data_dict: BatchedDataDict, input_ids: Tensor, cu: Any, g: _Groups
    ) -> Tensor:
        width = data_dict["input_ids"].shape[1]
        if self.use_fused_linear_logprobs:
            if g.cp_size > 1:
                raise RuntimeError("fused linear logprobs do not support context parallelism")
            return output.float()[:, : width - 1]
        start, end = _vocab_range(output, g.tp_rank)
        chunk = self.cfg.logprob_chunk_size
        if self.cfg.sequence_packing:
            return from_parallel_logits_to_logprobs_packed_sequences(
                output, input_ids, _host_ints(cu), width, start, end, g.tp_group,
                inference_only=True, cp_group=g.cp_group, chunk_size=chunk,
                sampling_params=self.sampling_params,
            )  # fmt: skip
        if g.cp_size > 1:
            raise RuntimeError(CP_NEEDS_PACKING)
        return from_parallel_logits_to_logprobs(
            output, data_dict["input_ids"], start, end, g.tp_group, inference_only=True,
            chunk_size=chunk, sampling_params=self.sampling_params,
        )  # fmt: skip

    def __call__(
        self,
        data_dict: BatchedDataDict,
        input_ids: Tensor,
        cu_seqlens_padded: Tensor | Sequence[int] | None,
        original_seq_length: int,
    ) -> OutputProcessor:
        """Bind one microbatch: returns ``f(output) -> (0, {"logprobs": [B, S]})``.

        Args:
            data_dict: The microbatch (``input_ids [B, S]``, masks).
            input_ids: Model input ids: the full packed row ``[1, T]`` when packed.
            cu_seqlens_padded: ``[B+1]`` span boundaries when packed, else ``None``.
            original_seq_length: Width before dense padding; the output is cut to it.

        Returns:
            The callable; ``logprobs[:, 0] = 0`` and ``logprobs[:, t] = log p(x_t | x_<t)``.
            Padding positions hold unmasked values (mask them with ``token_mask``).
        """

        def processor(output_tensor: Tensor) -> tuple[Tensor, dict[str, Any]]:
            g = _megatron_groups()
            with torch.no_grad():
                lp = self._next_token(output_tensor, data_dict, input_ids, cu_seqlens_padded, g)
                lp = F.pad(lp, (1, 0))  # stored convention: [B, S] with a leading 0
                if self.sampling_params is not None and self.sampling_params.filters:
                    mask = data_dict["token_mask"] * data_dict["sample_mask"].unsqueeze(-1)
                    lp = mask_out_neg_inf_logprobs(lp, mask, "prev_logprobs")
            return torch.zeros((), device=lp.device), {"logprobs": lp[:, :original_seq_length]}

        return processor


class TopkLogitsPostProcessor:
    """Forward-only callback returning the exact global top-k logits per position (spec §2.7).

    Args:
        cfg: :class:`PolicyConfig` or NeMo RL's policy mapping.
        k: Entries per position.
    """

    def __init__(self, cfg: PolicyConfig | Mapping[str, Any] | None, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"`k` must be a positive int, got {k!r}")
        self.cfg = load_policy_config(cfg)
        self.k = k

    def __call__(
        self,
        data_dict: BatchedDataDict,
        cu_seqlens_padded: Tensor | Sequence[int] | None,
        original_seq_length: int,
    ) -> OutputProcessor:
        """Bind one microbatch: ``f(output) -> (0, {"topk_logits", "topk_indices": [B, S, k]})``.

        Args:
            data_dict: The microbatch (``input_lengths [B]`` when packed).
            cu_seqlens_padded: ``[B+1]`` span boundaries when packed, else ``None``.
            original_seq_length: Width before dense padding.

        Returns:
            The callable; entries are position-aligned with the inputs (no shift).
        """

        def processor(output_tensor: Tensor) -> tuple[Tensor, dict[str, Any]]:
            g = _megatron_groups()
            start, end = _vocab_range(output_tensor, g.tp_rank)
            values, indices = distributed_vocab_topk(
                output_tensor, self.k, g.tp_group, start, end, self.cfg.logprob_chunk_size
            )
            if g.cp_size > 1 and not self.cfg.sequence_packing:
                raise RuntimeError(CP_NEEDS_PACKING)
            if self.cfg.sequence_packing:
                cu = _host_ints(cu_seqlens_padded)
                if g.cp_size > 1:
                    values = _gather_packed_over_cp(values, cu, g.cp_group)
                    indices = _gather_packed_over_cp(indices, cu, g.cp_group)
                width = data_dict["input_ids"].shape[1]
                values = _unpack_rows(values, cu, data_dict["input_lengths"], width)
                indices = _unpack_rows(indices, cu, data_dict["input_lengths"], width)
            result = {
                "topk_logits": values[:, :original_seq_length],
                "topk_indices": indices[:, :original_seq_length],
            }
            return torch.zeros((), device=values.device), result

        return processor


class TeacherFullPayloadPostProcessor:
    """Emit sampled-token logprobs plus the teacher's full-vocabulary payload (spec §2.8).

    The payload is returned in canonical ``[B, S, D]`` layout with TP and CP undone, on CPU in
    ``payload_dtype`` (Megatron's retained outputs then hold no accelerator memory).

    Args:
        cfg: :class:`PolicyConfig` or NeMo RL's policy mapping.
        payload: ``"hidden_states"`` (captured pre-LM-head states, ``D = H``) or ``"logits"``
            (TP-gathered, temperature-scaled logits, ``D = V``).
        payload_dtype: dtype of the returned payload.
        sampling_params: Top-k/top-p for the sampled-token logprobs.
    """

    def __init__(
        self,
        cfg: PolicyConfig | Mapping[str, Any] | None,
        payload: str,
        payload_dtype: torch.dtype,
        sampling_params: TrainingSamplingParams | None = None,
    ) -> None:
        if payload not in ("hidden_states", "logits"):
            raise ValueError(f"`payload` must be 'hidden_states' or 'logits', got {payload!r}")
        self.cfg = load_policy_config(cfg)
        self.payload = payload
        self.payload_dtype = payload_dtype
        self.logprobs = LogprobsPostProcessor(self.cfg, sampling_params)

    def _local_payload(self, output: Tensor, hidden_states: Tensor | None, g: _Groups) -> Tensor:
        if self.payload == "hidden_states":
            if hidden_states is None:
                raise ValueError(
                    "the hidden_states payload needs the captured pre-LM-head hidden states "
                    "(run the forward with enable_opd_full_capture=True)"
                )
            local = hidden_states.transpose(0, 1)  # [S/CP, B, H] -> [B, S/CP, H]
        else:
            local = output
            tp = g.tp_group.size()
            if tp > 1:
                parts = [torch.empty_like(output) for _ in range(tp)]
                dist.all_gather(parts, output.contiguous(), group=g.tp_group)
                local = torch.cat(parts, dim=-1)
        if local.shape[1] != output.shape[1]:
            raise ValueError(
                f"payload local sequence width {local.shape[1]} differs from the logits' "
                f"{output.shape[1]}; sequence-parallel hidden states must be gathered over TP "
                "before the payload is built"
            )
        return local

    def __call__(
        self,
        data_dict: BatchedDataDict,
        input_ids: Tensor,
        cu_seqlens_padded: Tensor | Sequence[int] | None,
        original_seq_length: int,
        hidden_states: Tensor | None = None,
    ) -> OutputProcessor:
        """Bind one microbatch: ``f(output) -> (0, {"logprobs": [B, S], "teacher_full_payload":
        [B, S, D]})``.

        Args:
            data_dict: The microbatch.
            input_ids: Model input ids (full packed row when packed).
            cu_seqlens_padded: ``[B+1]`` span boundaries when packed, else ``None``.
            original_seq_length: Width before dense padding.
            hidden_states: Captured pre-LM-head states ``[S/CP, B, H]`` (hidden-state payload).

        Returns:
            The callable.
        """
        logprobs = self.logprobs(data_dict, input_ids, cu_seqlens_padded, original_seq_length)

        def processor(output_tensor: Tensor) -> tuple[Tensor, dict[str, Any]]:
            loss, result = logprobs(output_tensor)
            g = _megatron_groups()
            with torch.no_grad():
                local = self._local_payload(output_tensor, hidden_states, g)
                if g.cp_size > 1 and not self.cfg.sequence_packing:
                    raise RuntimeError(CP_NEEDS_PACKING)
                if self.cfg.sequence_packing:
                    cu = _host_ints(cu_seqlens_padded)
                    if g.cp_size > 1:
                        local = _gather_packed_over_cp(local, cu, g.cp_group)
                    width = data_dict["input_ids"].shape[1]
                    local = _unpack_rows(local, cu, data_dict["input_lengths"], width)
                payload = local[:, :original_seq_length].to("cpu", self.payload_dtype)
            result["teacher_full_payload"] = payload
            return loss, result

        return processor


PostProcessingFunction = Union[  # noqa: UP007 - a runtime alias used with isinstance
    LossPostProcessor, LogprobsPostProcessor, TopkLogitsPostProcessor,
    TeacherFullPayloadPostProcessor,
]  # fmt: skip
"""Any post-processor :func:`forward_with_post_processing_fn` knows how to dispatch."""

KNOWN_POST_PROCESSORS = (
    LossPostProcessor,
    LogprobsPostProcessor,
    TopkLogitsPostProcessor,
    TeacherFullPayloadPostProcessor,
)


def should_reduce_loss_across_context_parallel(data: BatchedDataDict | dict[str, Any]) -> bool:
    """Whether scalar loss reporting must include CP ranks (direct prepacked data, CP-local loss).

    Args:
        data: The batch.

    Returns:
        True iff ``"packed_cu_seqlens"`` is a key of ``data``.
    """
    return "packed_cu_seqlens" in data


def strip_context_parallel_local_loss_metric(
    metrics: dict[str, list[Any]], enabled: bool
) -> dict[str, list[Any]]:
    """Remove the CP-local ``"loss"`` metric list after it entered the global reduction.

    Args:
        metrics: Per-microbatch metric lists keyed by name.
        enabled: Whether the losses were CP-local (:func:`should_reduce_loss_across_context_parallel`).

    Returns:
        A new dict without ``"loss"`` when enabled, else ``metrics`` unchanged.
    """
    if not enabled:
        return metrics
    return {key: value for key, value in metrics.items() if key != "loss"}
