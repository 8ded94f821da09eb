"""Which dtype the last stage's logits keep: ``defer_fp32_logits`` resolved per pass.

Under ``bf16-mixed`` megatron's ``Float16Module`` upcasts the last stage's whole output to fp32
(``fp32_output=True``): ``[tokens, V/TP]`` fp32 logits, and in the backward their fp32
gradient. Deferred, the logits stay bf16 (:func:`~lightning_mcore_rl.train.model_forward`
passes ``fp32_output=False``) and the chunked vocab-parallel kernels upcast one
``logprob_chunk_size`` chunk at a time and write the logits gradient in bf16.

Why the deferred path is exact where :func:`defers_fp32_logits` turns it on: the fp32 logits
are the bf16 logits upcast (exactly representable), and every chunked kernel upcasts the same
values, so its fp32 math is the same; its fp32 gradient is rounded to bf16 once in both paths
(by the kernel's write, or by the backward of ``Float16Module``'s cast). What is not the same:

* a temperature != 1: ``apply_temperature_scaling`` divides in place, so bf16 logits give a
  bf16-rounded ``z / T`` (the fp32 path divides in fp32);
* top-k/top-p filtering and ``logprob_chunk_size=None``: the loss input casts the whole logits
  to fp32 (docs/behaviour-reference.md §5.8), so deferring would only add the bf16 copy beside
  that fp32 one;
* two consumers of the logits (an entropy bonus beside the logprobs, distillation's ``H_all``
  beside the top-k logprobs): their gradients are rounded to bf16 each and summed in bf16
  instead of summed in fp32 and rounded once;
* losses on the raw output (``LossInputType.LOGIT``: value and reward heads would compute their
  loss in bf16), the draft and OPD-full inputs (whole-tensor upcasts; the OPD teacher is cast
  to the student's dtype) and custom ``prepare_fn``s (unknown use of the logits).
"""

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
    """Whether a pass keeps the last stage's logits in the model dtype.

    Args:
        setting: ``LogprobKernelConfig.defer_fp32_logits``: ``True``/``False`` are returned
            as given; ``None`` resolves to ``True`` exactly where the deferred path computes
            what the fp32-logit path does (module docstring).
        post_processing_fn: The pass's post-processor.
        sampling_params: The step's sampling parameters (temperature, top-k/top-p).

    Returns:
        The ``defer_fp32_logits`` to run the pass with. Under ``32-true`` either value gives
        the same (bitwise) result: the logits are fp32 already.
    """
    if setting is not None:
        return setting
    if not (
        _exact_sampling(sampling_params) and _exact_sampling(post_processing_fn.sampling_params)
    ):
        return False
    if post_processing_fn.cfg.logprob_chunk_size is None:
        return False
    return post_processing_fn.model_dtype_exact


__all__ = ["defers_fp32_logits", "one_kernel_consumer"]
