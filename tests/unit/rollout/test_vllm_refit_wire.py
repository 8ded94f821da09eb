"""The vLLM refit's wire format (``rollout/vllm_refit.py``) over a real private gloo pair, both
ends in this process (two threads), and the error when vLLM is not installed. No vLLM needed."""

from __future__ import annotations

import importlib.util
import socket
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_mcore_rl.rollout import VLLMRolloutSource
from lightning_mcore_rl.rollout.vllm_refit import (
    TRAINER,
    WORKER,
    receive_weights,
    refit_group,
    send_weights,
)

CPU = torch.device("cpu")


def _pair() -> tuple[object, object]:
    """The two ends of a private gloo group (each constructor waits for the other)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    timeout = timedelta(seconds=30)
    master = dist.TCPStore("127.0.0.1", port, 2, True, timeout, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout)
    ends: dict[int, object] = {}

    def join(rank: int, store: object) -> None:
        ends[rank] = refit_group(store, rank, timeout, CPU)

    threads = [
        threading.Thread(target=join, args=pair) for pair in ((TRAINER, master), (WORKER, client))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return ends[TRAINER], ends[WORKER]


def test_a_stream_arrives_bitwise_in_order_and_ends():
    generator = torch.Generator().manual_seed(0)
    weights = [
        ("model.embed_tokens.weight", torch.randn(7, 5, generator=generator)),
        ("model.layers.0.input_layernorm.weight", torch.randn(5, generator=generator)),
        ("lm_head.weight", torch.randn(3, 4, 2, generator=generator).bfloat16()),
        ("scalar", torch.tensor(2.5, dtype=torch.float64)),
        ("ids", torch.arange(6, dtype=torch.int64).view(2, 3)),
        ("ünïcode.weight", torch.randn(2, 2, generator=generator).half()),
        ("strided", torch.randn(4, 6, generator=generator).t()),  # sent contiguous
    ]
    trainer, worker = _pair()
    received: list[tuple[str, torch.Tensor]] = []
    thread = threading.Thread(target=lambda: received.extend(receive_weights(worker, CPU)))
    thread.start()
    sent = send_weights(trainer, iter(weights), CPU)
    thread.join(60)
    assert sent == (len(weights), sum(t.numel() * t.element_size() for _, t in weights))
    assert [n for n, _ in received] == [n for n, _ in weights]
    for (_, got), (_, want) in zip(received, weights, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got, want)


def test_an_unsupported_dtype_raises_naming_it():
    trainer, worker = _pair()
    thread = threading.Thread(target=lambda: list(receive_weights(worker, CPU)), daemon=True)
    thread.start()
    with pytest.raises(ValueError, match=r"torch.complex64 is not one of the dtypes a refit"):
        send_weights(trainer, [("c", torch.zeros(2, dtype=torch.complex64))], CPU)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_without_vllm_the_source_raises_naming_how_to_install_it():
    """Before any collective: the group is not touched."""
    with pytest.raises(ImportError, match=r"backend='vllm' needs vLLM.*\[vllm\].*bootstrap_vllm"):
        VLLMRolloutSource("unused-dir", group=None)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_without_vllm_the_recipe_refuses_the_backend_at_construction():
    """``backend="vllm"`` is refused when the recipe is built, not at the first rollout."""
    from lightning_mcore_rl.recipes.common import HFModelSpec, RecipeModel
    from lightning_mcore_rl.recipes.rollout_choice import recipe_rollout

    hf = RecipeModel(HFModelSpec(path="unread"), vocab_size=16, max_sequence_length=16)
    with pytest.raises(ImportError, match=r"backend='vllm' needs vLLM.*\[vllm\].*bootstrap_vllm"):
        recipe_rollout("vllm", hf)
    assert recipe_rollout("hf", hf).source is None  # the other backends are unaffected
