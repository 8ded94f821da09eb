"""Post-processors: per microbatch, the callable megatron's schedule applies to the last
stage's output -> `(loss, metrics)`."""

# The pass's groups arrive with each microbatch. Shapes: `B` sequences, `S` width of the unpacked
# batch, `T` packed tokens, `V_l = V/TP`, `k` top-k entries, `D` teacher payload width. Model
# output: `[B, S/CP, V_l]` (padded) or `[1, T/CP, V_l]` (packed); fused: the final hidden states
# `[B, S/CP, H]` / `[1, T/CP, H]`.

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses.loss_input import mask_out_neg_inf_logprobs
from lightning_mcore_rl.ops import (
    TrainingSamplingParams,
    distributed_vocab_topk,
    from_parallel_logits_to_logprobs,
    from_parallel_logits_to_logprobs_packed_sequences,
)
from lightning_mcore_rl.parallel import ParallelGroups, host_ints, resolve_groups, shard_range
from lightning_mcore_rl.train import cp_layout as pg
from lightning_mcore_rl.train.binding import Binding
from lightning_mcore_rl.train.cp_layout import OutputProcessor
from lightning_mcore_rl.train.fused import FusedLMHead, reject_filtering
from lightning_mcore_rl.train.policy_config import PolicyConfig, load_policy_config


class LogprobsPostProcessor:
    """Forward-only callback returning stored-convention token logprobs `[B, S]` (§2.6).

    Args:
        cfg: `PolicyConfig` or NeMo RL's policy mapping.
        sampling_params: top-k/top-p filtering (temperature is applied upstream).
        use_fused_linear_logprobs: the model output is the last stage's final hidden states.

    Raises:
        ValueError: `use_fused_linear_logprobs` with top-k/top-p filtering.
    """

    # fused: logprobs come from hidden x output weight (the `lm_head` the forward step binds);
    # docs/behaviour-reference.md §2.6

    trains = False
    needs_full_logits = False
    captures_hidden_states = False
    model_dtype_exact = True  # one chunked kernel reads the logits

    def __init__(
        self,
        cfg: PolicyConfig | Mapping[str, Any] | None,
        sampling_params: TrainingSamplingParams | None = None,
        use_fused_linear_logprobs: bool = False,
    ) -> None:
        if use_fused_linear_logprobs:
            reject_filtering(sampling_params, "LogprobsPostProcessor")
        self.cfg = load_policy_config(cfg)
        self.sampling_params = sampling_params
        self.use_fused_linear_logprobs = use_fused_linear_logprobs

    def bind(self, b: Binding) -> OutputProcessor:
        """The forward step's call: `__call__` with the microbatch's fields."""
        return self(
            b.data_dict, b.input_ids, b.cu_seqlens_padded, b.original_seq_length,
            lm_head=b.lm_head, groups=b.groups,
        )  # fmt: skip

    def _next_token(
        self,
        output: Tensor,
        data_dict: BatchedDataDict,
        input_ids: Tensor,
        cu: Any,
        g: ParallelGroups,
        lm_head: FusedLMHead | None,
    ) -> Tensor:
        ids = cast(Tensor, data_dict["input_ids"])  # [B, S] by the BatchedDataDict contract
        width = ids.shape[1]
        chunk = self.cfg.logprob_chunk_size
        if self.use_fused_linear_logprobs:  # output: hidden states [B, S/CP, H] / [1, T/CP, H]
            if lm_head is None:
                raise RuntimeError(
                    "LogprobsPostProcessor(use_fused_linear_logprobs=True) needs the `lm_head` "
                    "that forward_with_post_processing_fn(use_fused_linear_logprobs=True) binds"
                )
            if self.cfg.sequence_packing:
                # packed: the full row's ids; the kernel rolls them per span itself
                return lm_head.packed(
                    output, input_ids, host_ints(cu), width, g.tp_rank, g.tp_group,
                    g.cp_group, chunk, with_entropy=False, target_is_pre_rolled=False,
                ).logprobs  # fmt: skip
            # padded rows cannot be split over CP here: CP shards packed THD rows only
            if g.cp_size > 1:
                raise RuntimeError(pg.CP_NEEDS_PACKING)
            return lm_head.dense(
                output, ids, g.tp_rank, g.tp_group, None, chunk, with_entropy=False
            ).logprobs
        start, end = shard_range(output.shape[-1], g.tp_rank)
        if self.cfg.sequence_packing:
            return from_parallel_logits_to_logprobs_packed_sequences(
                output, input_ids, host_ints(cu), width, start, end, g.tp_group,
                inference_only=True, cp_group=g.cp_group, chunk_size=chunk,
                sampling_params=self.sampling_params,
            )  # fmt: skip
        # (as above) the padded layout has no CP split
        if g.cp_size > 1:
            raise RuntimeError(pg.CP_NEEDS_PACKING)
        return from_parallel_logits_to_logprobs(
            output, ids, start, end, g.tp_group, inference_only=True,
            chunk_size=chunk, sampling_params=self.sampling_params,
        )  # fmt: skip

    def __call__(
        self,
        data_dict: BatchedDataDict,
        input_ids: Tensor,
        cu_seqlens_padded: Tensor | Sequence[int] | None,
        original_seq_length: int,
        lm_head: FusedLMHead | None = None,
        *,
        groups: ParallelGroups | None = None,
    ) -> OutputProcessor:
        """Bind one microbatch -> `f(output) -> (0, {"logprobs": [B, S]})`, `logprobs[:, 0] = 0`,
        `logprobs[:, t] = log p(x_t | x_<t)`, padding unmasked (mask it with `token_mask`).

        Args:
            input_ids: the model ids: the full packed row `[1, T]` when packed.
            original_seq_length: the width before dense padding; the output is cut to it.
            lm_head: output weight and temperature (fused path, last stage), else `None`.
            groups: this rank's groups (`None`: megatron's initialised state).
        """

        groups = resolve_groups(groups)  # the seed API's callers pass none

        def processor(output_tensor: Tensor) -> tuple[Tensor, dict[str, Any]]:
            # forward-only: no graph is needed for the stored logprobs
            with torch.no_grad():
                lp = self._next_token(
                    output_tensor, data_dict, input_ids, cu_seqlens_padded, groups, lm_head
                )
                lp = F.pad(lp, (1, 0))  # stored convention: [B, S] with a leading 0
                # tokens top-k/top-p removed hold -inf logprobs: set to 0 (a warning for the valid
                # ones), since `0 * -inf` would poison a masked mean with NaN
                if self.sampling_params is not None and self.sampling_params.filters:
                    token_mask = cast(Tensor, data_dict["token_mask"])  # tensors by the contract
                    sample_mask = cast(Tensor, data_dict["sample_mask"])
                    mask = token_mask * sample_mask.unsqueeze(-1)
                    lp = mask_out_neg_inf_logprobs(lp, mask, "prev_logprobs")
            # the loss is a zero: forward-only passes run no backward
            return torch.zeros((), device=lp.device), {"logprobs": lp[:, :original_seq_length]}

        return processor


class TopkLogitsPostProcessor:
    """Forward-only callback returning the exact global top-k logits per position (§2.7).

    Args:
        cfg: `PolicyConfig` or NeMo RL's policy mapping.
        k: entries per position.
    """

    trains = False
    needs_full_logits = True  # the exact top-k needs every logit: no fused head
    captures_hidden_states = False
    use_fused_linear_logprobs = False
    sampling_params: TrainingSamplingParams | None = None  # raw logits: no filtering
    model_dtype_exact = True  # one chunked kernel reads the logits

    def __init__(self, cfg: PolicyConfig | Mapping[str, Any] | None, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"`k` must be a positive int, got {k!r}")
        self.cfg = load_policy_config(cfg)
        self.k = k

    def bind(self, b: Binding) -> OutputProcessor:
        """The forward step's call: `__call__` with the microbatch's fields."""
        return self(b.data_dict, b.cu_seqlens_padded, b.original_seq_length, groups=b.groups)

    def __call__(
        self,
        data_dict: BatchedDataDict,
        cu_seqlens_padded: Tensor | Sequence[int] | None,
        original_seq_length: int,
        *,
        groups: ParallelGroups | None = None,
    ) -> OutputProcessor:
        """Bind one microbatch -> `f(output) -> (0, {"topk_logits", "topk_indices": [B, S, k]})`,
        position-aligned with the inputs (no shift); `groups`: `None` reads megatron's state."""
        groups = resolve_groups(groups)  # the seed API's callers pass none
        g = groups

        def processor(output_tensor: Tensor) -> tuple[Tensor, dict[str, Any]]:
            start, end = shard_range(output_tensor.shape[-1], g.tp_rank)
            values, indices = distributed_vocab_topk(
                output_tensor, self.k, g.tp_group, start, end, self.cfg.logprob_chunk_size
            )
            if g.cp_size > 1 and not self.cfg.sequence_packing:
                raise RuntimeError(pg.CP_NEEDS_PACKING)
            if self.cfg.sequence_packing:
                assert cu_seqlens_padded is not None  # packed microbatches carry span boundaries
                cu = host_ints(cu_seqlens_padded)
                if g.cp_size > 1:
                    values = pg.gather_packed_over_cp(values, cu, g.cp_group)
                    indices = pg.gather_packed_over_cp(indices, cu, g.cp_group)
                width = cast(Tensor, data_dict["input_ids"]).shape[1]  # [B, S] by the contract
                values = pg.unpack_rows(values, cu, data_dict["input_lengths"], width)
                indices = pg.unpack_rows(indices, cu, data_dict["input_lengths"], width)
            result = {
                "topk_logits": values[:, :original_seq_length],
                "topk_indices": indices[:, :original_seq_length],
            }
            return torch.zeros((), device=values.device), result

        return processor


class TeacherFullPayloadPostProcessor:
    """Sampled-token logprobs plus the teacher's full-vocabulary payload `[B, S, D]` (§2.8).

    Args:
        cfg: `PolicyConfig` or NeMo RL's policy mapping.
        payload: `"hidden_states"` (pre-LM-head states, `D = H`) or `"logits"` (`D = V`).
        payload_dtype: dtype of the returned payload.
        sampling_params: top-k/top-p for the sampled-token logprobs.
    """

    # the payload has TP and CP undone, on CPU in `payload_dtype`; "logits" are TP-gathered and
    # temperature-scaled (docs/behaviour-reference.md §2.8)

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

    trains = False
    needs_full_logits = True  # the payload is the logits or the states before the head
    use_fused_linear_logprobs = False
    model_dtype_exact = True  # forward-only: one chunked kernel reads the logits

    @property
    def captures_hidden_states(self) -> bool:
        """Whether the forward step must capture the pre-LM-head states for the payload."""
        return self.payload == "hidden_states"

    @property
    def sampling_params(self) -> TrainingSamplingParams | None:
        """Top-k/top-p of the sampled-token logprobs."""
        return self.logprobs.sampling_params

    def bind(self, b: Binding) -> OutputProcessor:
        """The forward step's call: `__call__` with the microbatch's fields."""
        return self(
            b.data_dict, b.input_ids, b.cu_seqlens_padded, b.original_seq_length,
            hidden_states=b.hidden_states, groups=b.groups,
        )  # fmt: skip

    def _local_payload(
        self, output: Tensor, hidden_states: Tensor | None, g: ParallelGroups
    ) -> Tensor:
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
        *,
        groups: ParallelGroups | None = None,
    ) -> OutputProcessor:
        """Bind one microbatch -> `f(output) -> (0, {"logprobs": [B, S], "teacher_full_payload":
        [B, S, D]})`; `hidden_states`: the captured pre-LM-head states `[S/CP, B, H]`."""
        groups = resolve_groups(groups)  # the seed API's callers pass none
        logprobs = self.logprobs(
            data_dict, input_ids, cu_seqlens_padded, original_seq_length, groups=groups
        )
        g = groups

        def processor(output_tensor: Tensor) -> tuple[Tensor, dict[str, Any]]:
            loss, result = logprobs(output_tensor)
            with torch.no_grad():
                local = self._local_payload(output_tensor, hidden_states, g)
                if g.cp_size > 1 and not self.cfg.sequence_packing:
                    raise RuntimeError(pg.CP_NEEDS_PACKING)
                if self.cfg.sequence_packing:
                    assert cu_seqlens_padded is not None  # packed microbatches carry boundaries
                    cu = host_ints(cu_seqlens_padded)
                    if g.cp_size > 1:
                        local = pg.gather_packed_over_cp(local, cu, g.cp_group)
                    width = cast(Tensor, data_dict["input_ids"]).shape[1]  # [B, S]
                    local = pg.unpack_rows(local, cu, data_dict["input_lengths"], width)
                # on CPU: megatron's retained outputs then hold no accelerator memory
                payload = local[:, :original_seq_length].to("cpu", self.payload_dtype)
            result["teacher_full_payload"] = payload
            return loss, result

        return processor


class PostProcessingFunction(Protocol):
    """A post-processor as the forward step uses it: the four classes above, or one of a user's
    with the same members (no dispatch on the class)."""

    cfg: PolicyConfig

    @property
    def trains(self) -> bool:
        """A training loss: the draft's and MTP's terms join it."""

    @property
    def needs_full_logits(self) -> bool:
        """It reads every logit (top-k, payload), which the fused head never materialises."""

    @property
    def use_fused_linear_logprobs(self) -> bool:
        """Built for the fused head's hidden-state output."""

    @property
    def captures_hidden_states(self) -> bool:
        """The forward step must capture the pre-LM-head states for it."""

    @property
    def sampling_params(self) -> TrainingSamplingParams | None:
        """Its top-k/top-p (and the temperature it was built with)."""

    @property
    def model_dtype_exact(self) -> bool:
        """Whether logits kept in the model dtype give its fp32 result."""

    def bind(self, b: Binding) -> OutputProcessor:
        """``f(output) -> (loss, metrics)`` for one microbatch."""
