"""Which dtype the last stage's logits keep: `defer_fp32_logits` resolved per pass (deferred:
bf16 logits, the chunked vocab-parallel kernels upcast one `logprob_chunk_size` chunk at a time
and write the logits gradient in bf16, instead of `Float16Module`'s fp32 `[tokens, V/TP]`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning_mcore_rl.losses import LossFunction, LossInputType
from lightning_mcore_rl.losses.loss_input._common import _needs_entropy
from lightning_mcore_rl.ops import TrainingSamplingParams

if TYPE_CHECKING:
    from lightning_mcore_rl.train.post_processors import PostProcessingFunction


def one_kernel_consumer(loss_fn: LossFunction) -> bool:
    """The loss input reaches the logits through exactly one chunked vocab-parallel kernel."""
    if loss_fn.input_type is LossInputType.LOGPROB:
        return not _needs_entropy(loss_fn)  # the entropy bonus is a second kernel
    if loss_fn.input_type is LossInputType.DISTILLATION:
        cfg: Any = getattr(loss_fn, "cfg", None)  # DISTILLATION losses carry their config
        # H_all, a second kernel, exactly when losses/loss_input/_draft.py computes it
        return cfg is not None and not (cfg.zero_outside_topk and cfg.kl_type != "forward")
    return False


def _exact_sampling(params: TrainingSamplingParams | None) -> bool:
    """No temperature division and no filtering (the whole-logits fp32 cast) in the pass."""
    return params is None or (params.temperature == 1.0 and not params.filters)


def defers_fp32_logits(
    setting: bool | None,
    post_processing_fn: PostProcessingFunction,
    sampling_params: TrainingSamplingParams | None,
) -> bool:
    """Whether a pass keeps the last stage's logits in the model dtype: `setting`
    (`LogprobKernelConfig.defer_fp32_logits`) as given, `None`: exactly where that is exact."""
    if setting is not None:
        return setting
    # exact: the fp32 logits are the bf16 logits upcast (exactly representable) and every
    # chunked kernel upcasts the same values; the fp32 gradient is rounded to bf16 once in both
    # paths (the kernel's write, or the backward of Float16Module's cast). Not exact: a
    # temperature != 1 (the in-place division rounds z / T to bf16); top-k/top-p or
    # logprob_chunk_size=None (the loss input casts the whole logits to fp32,
    # behaviour-reference 5.8: deferring only adds a bf16 copy); two consumers of the logits
    # (each gradient rounded to bf16, summed in bf16); LOGIT losses, the draft and OPD-full
    # inputs and custom prepare_fns (post_processing_fn.model_dtype_exact). Under 32-true either
    # value gives the same result
    if not (
        _exact_sampling(sampling_params) and _exact_sampling(post_processing_fn.sampling_params)
    ):
        return False
    if post_processing_fn.cfg.logprob_chunk_size is None:
        return False
    return post_processing_fn.model_dtype_exact


__all__ = ["defers_fp32_logits", "one_kernel_consumer"]
