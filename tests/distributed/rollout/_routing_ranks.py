"""Rank function of the rollout-routing test: the embedded sampler records each position's
experts while generating, and the train step routes the same sequences as recorded
(module-level: pickled to the ranks)."""

from __future__ import annotations

from typing import Any

import torch

PROMPT, NEW, ROWS = 4, 6, 4


def sampler_routing_rank(_rank: int, ep: int, packing: bool) -> dict[str, Any]:
    """At EP=``ep`` (DP = world): generate from this rank's prompts with and without the KV
    cache, recording the routing; then the trainer's logprob pass (no replay) of the finished
    rows with the recording as ``routed_experts``: its ``moe/router_mismatch_fraction``."""
    from _router_replay_ranks import PG_CFG, _setup

    from lightning_mcore_rl.data import BatchedDataDict
    from lightning_mcore_rl.losses import ClippedPGLossFn
    from lightning_mcore_rl.rollout.sampler import generate
    from lightning_mcore_rl.train import LossPostProcessor, Microbatching, StepContext
    from lightning_mcore_rl.train.step import run_global_batch

    setup, groups, _ = _setup(ep)
    setup.config.moe_enable_routing_replay = False  # the trainer routes by itself
    model = setup.chunks[0]
    prompts = torch.randint(1, 128, (ROWS, PROMPT), generator=torch.Generator().manual_seed(1))
    outs = {
        cached: generate(
            model,
            prompts,
            max_new_tokens=NEW,
            record_routing=True,
            kv_cache=cached,
            generator=torch.Generator().manual_seed(7 + groups.dp_rank),
        )  # fmt: skip
        for cached in (False, True)
    }
    plain = generate(
        model,
        prompts,
        max_new_tokens=NEW,
        generator=torch.Generator().manual_seed(7 + groups.dp_rank),
    )
    out = outs[False]
    length = PROMPT + NEW
    batch = BatchedDataDict(
        input_ids=out.tokens,
        input_lengths=torch.full((ROWS,), length),
        token_mask=out.completion_mask.float(),
        sample_mask=torch.ones(ROWS),
        advantages=torch.ones(ROWS, length),
        prev_logprobs=out.logprobs,
        generation_logprobs=out.logprobs,
        routed_experts=out.routed_experts,
    )
    loss_fn = ClippedPGLossFn(PG_CFG)
    context = StepContext(groups, Microbatching(micro_batch_size=2, sequence_packing=packing))
    metrics = run_global_batch(
        setup.chunks, batch, context,
        loss=LossPostProcessor(loss_fn, {"sequence_packing": {"enabled": packing}}),
        normalizations=loss_fn.metric_normalizations, forward_only=True,
    ).metrics  # fmt: skip
    return {
        "shape": tuple(out.routed_experts.shape),
        "cached_equal": torch.equal(outs[True].routed_experts, out.routed_experts),
        "cached_tokens_equal": torch.equal(outs[True].tokens, out.tokens),
        "same_samples": torch.equal(plain.tokens, out.tokens)
        and torch.equal(plain.logprobs, out.logprobs),
        "mismatch": float(metrics["moe/router_mismatch_fraction"]),
        "experts": out.routed_experts,
    }


def dense_record_error_rank(_rank: int) -> str:
    """``"Type: message"`` of ``generate(record_routing=True)`` on the dense tiny GPT."""
    from lightning_mcore_rl.models.tiny_gpt import tiny_gpt
    from lightning_mcore_rl.rollout.sampler import generate
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state()
    prompts = torch.ones(2, 3, dtype=torch.long)
    try:
        generate(tiny_gpt(), prompts, max_new_tokens=1, generator=torch.Generator(),
                 record_routing=True)  # fmt: skip
    except ValueError as err:
        return f"ValueError: {err}"
    return ""


def hf_source_routing_rank(_rank: int, hf_dir: str) -> dict[str, Any]:
    """The HF source's recorded routing of left-padded prompts, and megatron's routing of the
    same model (imported with HFBridge) for each row's real tokens alone: ``{"hf": [B, T, L, K],
    "megatron": [list of [t_i, L, K]], "starts": [B]}``."""
    import torch.distributed as dist
    from megatron.core.transformer.moe.router import Router

    from lightning_mcore_rl.models import HFBridge
    from lightning_mcore_rl.parallel import megatron_groups
    from lightning_mcore_rl.rollout import HFRolloutSource, SamplingConfig
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state()
    lengths = torch.tensor([4, 2, 3])
    prompts = torch.randint(4, 20, (3, 4), generator=torch.Generator().manual_seed(2))
    prompts[torch.arange(4)[None, :] < (4 - lengths)[:, None]] = 0  # left padding
    source = HFRolloutSource(hf_dir, dist.group.WORLD)
    rollout = source.generate(prompts, SamplingConfig(max_new_tokens=5, seed=3), lengths)
    groups = megatron_groups()
    bridge = HFBridge.from_pretrained(hf_dir)
    chunk = bridge.build_chunk(bridge.transformer_config(groups), groups=groups).eval()
    calls: list[torch.Tensor] = []

    def hook(router: Any, _args: Any, output: Any) -> None:
        calls.append(output[1].float().topk(int(router.topk), dim=1).indices.sort(1).values)

    handles = [m.register_forward_hook(hook) for m in chunk.modules() if isinstance(m, Router)]
    starts = (4 - lengths).tolist()
    megatron = []
    with torch.no_grad():
        for row, start in enumerate(starts):
            ids = rollout.tokens[row, start:][None]
            calls.clear()
            chunk(ids, torch.arange(ids.shape[1])[None], None)
            megatron.append(torch.stack(calls, dim=1))  # [t, L, K]
    for handle in handles:
        handle.remove()
    return {"hf": rollout.routed_experts, "megatron": megatron, "starts": starts}


def capacity_record_error_rank(_rank: int) -> str:
    """``"Type: message"`` of ``generate(record_routing=True)`` on a tiny MoE GPT with a
    capacity factor."""
    from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
    from lightning_mcore_rl.rollout.sampler import generate
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state()
    config = tiny_gpt_config(
        num_moe_experts=4, moe_router_topk=2, add_bias_linear=False,
        moe_expert_capacity_factor=1.0, moe_token_drop_policy="probs",
    )  # fmt: skip
    try:
        generate(tiny_gpt(config), torch.ones(2, 3, dtype=torch.long), max_new_tokens=1,
                 generator=torch.Generator(), record_routing=True)  # fmt: skip
    except ValueError as err:
        return f"ValueError: {err}"
    return ""
