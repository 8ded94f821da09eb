"""On a GPU: the chunked vocab-parallel logprob kernel is exact against fp32 torch and uses a
fraction of the memory of megatron-core's ``vocab_parallel_cross_entropy`` (TP=1, one GPU).

Memory is measured with ``torch.cuda.max_memory_allocated`` (exact, unlike the CPU benchmark's RSS
sampling); the numbers are printed for BENCHMARKS.md (`pytest -m gpu -s`).
"""

from __future__ import annotations

import pytest
import torch

from lightning_mcore_rl.testing import run_on_ranks

TOKENS, VOCAB = 8192, 128 * 1024


def _peak_extra(fn) -> tuple[float, torch.Tensor]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30, out


def _run(rank: int) -> dict[str, float]:
    import torch.distributed as dist
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from lightning_mcore_rl.ops import distributed_logprob
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state()
    group = dist.group.WORLD
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(1, TOKENS, VOCAB, device="cuda", generator=gen).bfloat16()
    target = torch.randint(0, VOCAB, (1, TOKENS), device="cuda", generator=gen)

    def ours() -> torch.Tensor:
        x = logits.detach().requires_grad_()
        lp = distributed_logprob(x, target, 0, VOCAB, group, chunk_size=512)
        lp.sum().backward()
        return torch.cat([lp.detach().flatten(), x.grad.float().flatten()[:TOKENS]])

    def megatron() -> torch.Tensor:
        x = logits.detach().requires_grad_()
        loss = vocab_parallel_cross_entropy(x.transpose(0, 1).contiguous(), target.t())
        (-loss).sum().backward()
        return x.grad

    def reference() -> torch.Tensor:
        x = logits.detach().float().requires_grad_()
        lp = torch.log_softmax(x, -1).gather(-1, target[..., None]).squeeze(-1)
        lp.sum().backward()
        return torch.cat([lp.detach().flatten(), x.grad.flatten()[:TOKENS]])

    ours_gib, ours_out = _peak_extra(ours)
    megatron_gib, _ = _peak_extra(megatron)
    _, ref_out = _peak_extra(reference)
    return {
        "ours_gib": ours_gib,
        "megatron_gib": megatron_gib,
        "bf16_logits_gib": logits.numel() * 2 / 2**30,
        "max_diff": (ours_out - ref_out).abs().max().item(),
    }


@pytest.mark.gpu
def test_chunked_logprob_exact_and_small_on_gpu():
    (result,) = run_on_ranks(_run, 1, emulate_cuda=False, timeout=300)
    print(result)
    # bf16 inputs, fp32 math in both: only reduction order differs
    assert result["max_diff"] < 1e-4
    # the chunked kernel returns a bf16 logits gradient (1x the logits) plus one fp32 chunk
    assert result["ours_gib"] < 0.5 * result["megatron_gib"]
