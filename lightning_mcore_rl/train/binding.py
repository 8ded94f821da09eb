"""What the forward step hands a post-processor for one microbatch (``PostProcessor.bind``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import Tensor

from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.parallel import ParallelGroups

if TYPE_CHECKING:  # the fused head is opened only by the passes that use it
    from lightning_mcore_rl.train.fused import FusedLMHead


@dataclass(frozen=True)
class Binding:
    """One microbatch of one pass, as a post-processor binds it."""

    # the microbatch `[B, S, ...]` the losses read (with the draft's `student_logits [B, S, V]`
    # when the pass trains it)
    data_dict: BatchedDataDict
    input_ids: Tensor  # model ids, `[B, S_pad]` padded or the packed row `[1, T]`
    packed_seq_params: Any  # megatron's `PackedSeqParams` when packed, else `None`
    cu_seqlens_padded: Tensor | None  # `[B+1]` span boundaries when packed, else `None`
    original_seq_length: int  # `S` before dense padding
    groups: ParallelGroups
    num_microbatches: int | None  # `M` of the pass (a loss scales by it)
    global_valid_seqs: Tensor | None
    global_valid_toks: Tensor | None
    lm_head: FusedLMHead | None  # output weight and temperature on the fused last stage
    hidden_states: Tensor | None  # captured pre-LM-head states `[S/CP, B, H]` (payload)
