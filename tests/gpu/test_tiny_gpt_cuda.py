"""On a real GPU the tiny GPT (no emulation) gives the CPU-emulated logits."""

from __future__ import annotations

import pytest
import torch

from lightning_mcore_rl.testing import run_on_ranks


def _logits(rank: int, device: str) -> torch.Tensor:
    from lightning_mcore_rl.testing import init_megatron_state, tiny_gpt

    init_megatron_state()
    model = tiny_gpt().to(device)
    tokens = torch.arange(32, device=device).view(2, 16)
    with torch.no_grad():
        return model(tokens, torch.arange(16, device=device).expand(2, 16), None).float().cpu()


@pytest.mark.gpu
def test_cuda_logits_match_cpu_emulation():
    (cpu,) = run_on_ranks(_logits, 1, "cpu")
    (gpu,) = run_on_ranks(_logits, 1, "cuda", emulate_cuda=False)
    # TF32 may be used by cuBLAS for fp32 matmuls: ~1e-3 relative.
    torch.testing.assert_close(gpu, cpu, atol=2e-3, rtol=2e-3)
