"""``cpu_emulation``: each patch does what megatron-core needs, and leaving restores everything."""

from __future__ import annotations

import queue

import pytest
import torch

from lightning_mcore_rl._compat import ABSENT
from lightning_mcore_rl.testing import cpu_emulation, patched_attributes


def _originals() -> dict[tuple[int, str], object]:
    return {
        (id(owner), name): owner.__dict__.get(name, ABSENT) for owner, name in patched_attributes()
    }


def test_outside_the_scope_cuda_requests_fail_and_every_attribute_is_original():
    before = _originals()
    with cpu_emulation(), cpu_emulation():  # nested entry is harmless
        pass
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")
    after = _originals()
    assert all(after[key] is value for key, value in before.items())
    assert torch._C._len_torch_function_stack() == 0


def test_nested_exit_keeps_the_outer_scope_active():
    with cpu_emulation():
        with cpu_emulation():
            pass
        assert torch.zeros(1, device="cuda").device.type == "cpu"
    with pytest.raises((RuntimeError, AssertionError)):
        torch.zeros(1, device="cuda")


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0), 0, 3])
def test_device_requests_map_to_cpu(device):
    with cpu_emulation():
        assert torch.empty(2, device=device).device.type == "cpu"
        assert torch.ones(2).to(device).device.type == "cpu"
        assert torch.ones(2).to(device, torch.float64).dtype == torch.float64


def test_cuda_method_is_a_no_op_and_type_reports_cuda_types():
    with cpu_emulation():
        x = torch.ones(3)
        assert x.cuda() is x
        assert x.type() == "torch.cuda.FloatTensor"
        assert x.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert x.type(torch.float64).dtype == torch.float64  # conversions still work
    assert torch.ones(1).type() == "torch.FloatTensor"


def test_cuda_helpers_use_the_cpu_rng_and_do_nothing_for_sync():
    with cpu_emulation():
        assert torch.cuda.current_device() == "cpu"
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.manual_seed(123)
        first = torch.rand(4)
        torch.manual_seed(123)  # would recurse forever if manual_seed went through it
        assert torch.equal(torch.rand(4), first)
        state = torch.cuda.get_rng_state()
        a = torch.rand(4)
        torch.cuda.set_rng_state(state)
        assert torch.equal(torch.rand(4), a)


def test_megatron_rng_tracker_forks_seeded_streams():
    from megatron.core.tensor_parallel import random as mcore_random

    with cpu_emulation():
        tracker = mcore_random.CudaRNGStatesTracker()
        tracker.add("model-parallel-rng", 99)
        torch.manual_seed(0)
        with tracker.fork("model-parallel-rng"):
            forked = torch.rand(4)
        outside = torch.rand(4)
        torch.manual_seed(99)
        assert torch.equal(forked, torch.rand(4))  # the fork uses the stream seeded with 99
        torch.manual_seed(0)
        assert torch.equal(outside, torch.rand(4))  # ... and restores the default stream after


def test_gradient_clipping_type_checks_pass_only_under_emulation():
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    def params() -> list[torch.nn.Parameter]:
        p = torch.nn.Parameter(torch.zeros(4))
        p.grad = torch.full((4,), 2.0)
        return [p]

    with pytest.raises(AssertionError):
        clip_grad_by_total_norm_fp32(params(), max_norm=1.0, total_norm=4.0)
    with cpu_emulation():
        (p,) = params()
        clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=4.0)
    # clip coefficient = max_norm / (total_norm + 1e-6)
    torch.testing.assert_close(p.grad, torch.full((4,), 2.0 / (4.0 + 1e-6)))


def test_checkpoint_writer_uses_an_in_process_queue():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    with cpu_emulation():
        assert isinstance(filesystem_async._get_write_results_queue(), queue.Queue)


def test_torch_norm_builds_under_sequence_parallel_and_is_tagged():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
    )
    with pytest.raises(AssertionError, match="sequence parallel"):
        WrappedTorchNorm(config, 8)
    with cpu_emulation():
        norm = WrappedTorchNorm(config, 8)
    assert isinstance(norm, torch.nn.LayerNorm)
    assert all(p.sequence_parallel for p in norm.parameters())


def test_moe_dispatcher_streams_and_split_sizes_are_host_side():
    import numpy as np
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    missing = object()
    before = moe_utils.__dict__.get("te_general_gemm", missing)  # megatron-core >= 0.19 binds it
    with cpu_emulation():
        stream = torch.cuda.Stream()
        assert stream is torch.cuda.current_stream()  # no side stream: splits move in place
        with torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.current_stream())
        stream.record_event().synchronize()
        splits = token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3, 1]), as_numpy=True)
        assert isinstance(splits, np.ndarray) and splits.tolist() == [3, 1]
        assert moe_utils.te_general_gemm is None  # the router's torch.mm path, without TE
    assert moe_utils.__dict__.get("te_general_gemm", missing) is before  # restored as it was
