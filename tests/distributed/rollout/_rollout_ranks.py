"""Rank functions of the rollout-source tests (``run_on_ranks``): the embedded source against
``generate``, the Hugging Face source against the megatron chunk it is refit from, and the GRPO
recipe with ``RolloutSpec(backend="hf")`` under a Trainer."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers.trainer import cpu_trainer
from lightning.pytorch import Callback
from megatron.core import parallel_state as ps

from lightning_mcore_rl import MCoreRLStrategy
from lightning_mcore_rl.models import HFBridge
from lightning_mcore_rl.parallel import megatron_groups
from lightning_mcore_rl.recipes import GRPOModule, HFModelSpec, PromptDataModule, RolloutSpec
from lightning_mcore_rl.rollout import (
    HFRolloutSource,
    MegatronRolloutSource,
    RolloutSource,
    SamplingConfig,
    VLLMRolloutSource,
    generate,
    mismatch_extrema,
)
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.testing import init_megatron_state, tiny_gpt

PROMPTS = torch.randint(0, 128, (3, 5), generator=torch.Generator().manual_seed(0))
SAMPLING = SamplingConfig(max_new_tokens=6, temperature=0.7, seed=7)


def _megatron_logprobs(chunk: torch.nn.Module, tokens: torch.Tensor, temperature: float) -> Any:
    """``[B, N]`` logprobs of the completion tokens under ``log_softmax(logits / T)`` of the
    megatron chunk (TP-gathered logits, one forward over the whole sequence)."""
    with torch.no_grad():
        local = chunk(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None).float()
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    logits = torch.cat(parts, dim=-1)[:, PROMPTS.shape[1] - 1 : -1] / temperature
    picked = tokens[:, PROMPTS.shape[1] :, None]
    return torch.log_softmax(logits, dim=-1).gather(-1, picked).squeeze(-1)


@torch.no_grad()
def _perturb(chunk: torch.nn.Module, seed: int) -> None:
    """A stand-in optimizer step: the same noise on every rank for the same parameter (so the
    replicated norms stay replicated)."""
    generator = torch.Generator().manual_seed(seed)
    for param in chunk.parameters():
        param.add_(0.05 * torch.randn(param.shape, generator=generator))


def _cached(model: torch.nn.Module, tp_group: Any, kv_cache: bool = True) -> Any:
    """``generate`` with ``SAMPLING``, with or without the KV cache."""
    return generate(
        model,
        PROMPTS,
        max_new_tokens=SAMPLING.max_new_tokens,
        generator=torch.Generator().manual_seed(SAMPLING.seed),
        temperature=SAMPLING.temperature,
        tp_group=tp_group,
        kv_cache=kv_cache,
    )


def pipelined(rank: int, pp: int) -> dict[str, Any]:
    """The embedded sampler on the tiny GPT at PP=``pp``, without and with the KV cache."""
    init_megatron_state(pipeline_model_parallel_size=pp)
    groups = megatron_groups()
    model = tiny_gpt(groups=groups)
    pp_group = groups.pp_group if pp > 1 else None
    return {
        cache: generate(
            model,
            PROMPTS,
            max_new_tokens=SAMPLING.max_new_tokens,
            generator=torch.Generator().manual_seed(SAMPLING.seed),
            temperature=SAMPLING.temperature,
            pp_group=pp_group,
            kv_cache=cache,
        )
        for cache in (False, True)
    }


def sources(rank: int, hf_dir: str) -> dict[str, Any]:
    """TP=2: the embedded source vs ``generate``; the HF source before/after a refit vs the
    megatron chunk; the errors."""
    init_megatron_state(tensor_model_parallel_size=2)
    groups = megatron_groups()
    tp_group = groups.tp_group
    model = tiny_gpt(groups=groups)
    embedded = MegatronRolloutSource(model, tp_group)
    direct = generate(
        model,
        PROMPTS,
        max_new_tokens=SAMPLING.max_new_tokens,
        generator=torch.Generator().manual_seed(SAMPLING.seed),
        temperature=SAMPLING.temperature,
        tp_group=tp_group,
    )
    wrapped = embedded.generate(PROMPTS, SAMPLING)
    cached = {"tiny_gpt": (direct, _cached(model, tp_group))}

    bridge = HFBridge.from_pretrained(hf_dir)
    chunk = bridge.build_chunk(bridge.transformer_config(groups), groups=groups)
    cached["llama"] = (_cached(chunk, tp_group, kv_cache=False), _cached(chunk, tp_group))
    hf = HFRolloutSource(hf_dir, groups.mp_group)
    initial = hf.generate(PROMPTS, SAMPLING)
    initial_ref = _megatron_logprobs(chunk, initial.tokens, SAMPLING.temperature)
    _perturb(chunk, seed=11)
    stale = hf.generate(PROMPTS, SAMPLING)
    stale_ref = _megatron_logprobs(chunk, stale.tokens, SAMPLING.temperature)
    hf.update_weights(bridge.export_hf_weights([chunk], groups))
    refit = hf.generate(PROMPTS, SAMPLING)
    refit_ref = _megatron_logprobs(chunk, refit.tokens, SAMPLING.temperature)

    # the extrema over a 2-rank "DP" group: rank r's ratios are exp(r + 0.1), exp(-0.2 r)
    masked = {
        "generation_logprobs": torch.tensor([[0.0, -1.0, -1.0 - rank - 0.1, -1.0]]),
        "prev_logprobs": torch.tensor([[0.0, -1.0 - 0.2 * rank, -1.0, -9.0]]),
        "token_mask": torch.tensor([[0.0, 1.0, 1.0, 0.0]]),
    }
    extrema = mismatch_extrema(masked, dist.group.WORLD)
    with pytest.raises(ValueError, match="must be the same"):
        mismatch_extrema({**masked, "token_mask": torch.ones(1, 3)}, dist.group.WORLD)
    with pytest.raises(ValueError, match="unknown names \\['bogus'\\]"):
        hf.update_weights([("bogus", torch.zeros(1))])
    with pytest.raises(ValueError, match="`prompts` must be integer"):
        hf.generate(PROMPTS.float(), SAMPLING)
    return {
        "extrema": extrema,
        "cached": cached,
        "is_protocol": isinstance(embedded, RolloutSource) and isinstance(hf, RolloutSource),
        "direct": direct,
        "wrapped": wrapped,
        "generator": hf.is_generator,
        "initial": initial,
        "initial_ref": initial_ref,
        "stale": stale,
        "stale_ref": stale_ref,
        "refit": refit,
        "refit_ref": refit_ref,
    }


class _Rows(Callback):
    """Every step's logged metrics, as floats."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


class _RecordingGRPO(GRPOModule):
    """Records each step's largest |generation_logprobs - prev_logprobs| on completion tokens
    (the trainer's ``compute_logprobs`` vs the rollout source) before training on the batch, and
    the smallest generation logprob."""

    def __init__(self, **kwargs: Any) -> None:
        # the recorded error compares the stored prev_logprobs: keep their forward-only pass
        kwargs.setdefault("prev_logprobs_pass", "always")
        super().__init__(**kwargs)
        self.max_errors: list[float] = []
        self.min_logprobs: list[float] = []

    def forward_backward(self, batch: Any, forward_only: bool = False) -> Any:
        mask = batch["token_mask"].bool()
        diff = (batch["generation_logprobs"] - batch["prev_logprobs"])[mask]
        self.max_errors.append(float(diff.abs().max()))
        self.min_logprobs.append(float(batch["generation_logprobs"][mask].min()))
        return super().forward_backward(batch, forward_only)


def grpo_run(
    rank: int,
    hf_dir: str,
    backend: str,
    tp: int,
    pp: int,
    steps: int,
    filters: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """GRPO of the HF model with ``RolloutSpec(backend=backend, **filters)`` (``top_k``,
    ``top_p``): ``steps`` steps at TP=``tp``, PP=``pp`` (DP = world / (TP PP)), temperature
    0.8."""
    rows = _Rows()
    trainer = cpu_trainer(
        strategy=MCoreRLStrategy(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            microbatching=MicrobatchConfig(micro_batch_size=4),
        ),
        max_steps=steps,
        gradient_clip_val=1.0,
        callbacks=[rows],
    )
    module = _RecordingGRPO(
        model=HFModelSpec(path=hf_dir),
        rollout=RolloutSpec(
            group_size=2, max_new_tokens=4, temperature=0.8, backend=backend, **(filters or {})
        ),
        lr=1e-2,
    )
    data = PromptDataModule(prompts_per_step=4, num_steps=steps)
    trainer.fit(module, datamodule=data)
    source = module.rollout_source.source
    engines = (HFRolloutSource, VLLMRolloutSource)
    generator = source.is_generator if isinstance(source, engines) else None
    return {
        "rows": rows.rows,
        "max_errors": module.max_errors,
        "min_logprobs": module.min_logprobs,
        "generator": generator,
    }


class _StaleGRPO(GRPOModule):
    """Records, at every step, how far the rollout's ``generation_logprobs`` are from the
    trainer's ``compute_logprobs`` of the same tokens under the current weights (``now``) and
    under the previous step's (``previous``, from a copy taken at that step's start)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.snapshots: list[list[torch.Tensor]] = []
        self.now: list[float] = []
        self.previous: list[float] = []

    def make_rollout(self, prompts: Any) -> Any:
        params = [p for chunk in self.mcore_strategy.model_chunks for p in chunk.parameters()]
        self.snapshots.append([p.detach().clone() for p in params])
        data, rewards = super().make_rollout(prompts)
        mask = data["token_mask"].bool()
        gen = data["generation_logprobs"][mask]
        self.now.append(float((gen - self.compute_logprobs(data)[mask]).abs().max()))
        if len(self.snapshots) > 1:
            with torch.no_grad():
                for p, old in zip(params, self.snapshots[-2], strict=True):
                    p.copy_(old)
                before = self.compute_logprobs(data)[mask]
                for p, new in zip(params, self.snapshots[-1], strict=True):
                    p.copy_(new)
            self.previous.append(float((gen - before).abs().max()))
        return data, rewards


def async_grpo_run(
    rank: int, hf_dir: str | None, backend: str, tp: int, steps: int, max_staleness: int
) -> dict[str, Any]:
    """GRPO with ``RolloutSpec(backend=backend, max_staleness=max_staleness)`` at TP=``tp``
    (DP = world / TP): the tiny GPT (``hf_dir=None``) or the HF model, temperature 0.8, lr 1e-2
    (so one step moves the logprobs by far more than the tolerances)."""
    rows = _Rows()
    trainer = cpu_trainer(
        strategy=MCoreRLStrategy(
            tensor_model_parallel_size=tp, microbatching=MicrobatchConfig(micro_batch_size=4)
        ),
        max_steps=steps,
        gradient_clip_val=1.0,
        callbacks=[rows],
    )
    module = _StaleGRPO(
        **({} if hf_dir is None else {"model": HFModelSpec(path=hf_dir)}),
        rollout=RolloutSpec(
            group_size=2,
            max_new_tokens=4,
            temperature=0.8,
            backend=backend,
            max_staleness=max_staleness,
        ),
        lr=1e-2,
    )
    data = PromptDataModule(prompts_per_step=4, num_steps=steps)
    trainer.fit(module, datamodule=data)
    return {
        "rows": rows.rows,
        "now": module.now,
        "previous": module.previous,
        "queued": len(module.rollout_queue),
    }


def async_without_peek(rank: int) -> str:
    """``max_staleness=1`` with a plain ``DataLoader`` (no ``peek``): the error's message."""
    from torch.utils.data import DataLoader

    from lightning_mcore_rl.recipes.grpo import PromptDataset

    module = GRPOModule(rollout=RolloutSpec(max_staleness=1))
    loader = DataLoader(PromptDataset(module.task, 8), batch_size=4)
    trainer = cpu_trainer(
        strategy=MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=4)), max_steps=1
    )
    with pytest.raises(TypeError) as error:
        trainer.fit(module, train_dataloaders=loader)
    return str(error.value)


def check_one_step_stale(result: dict[str, Any], steps: int, tol: float, moved: float) -> None:
    """``async_grpo_run`` at ``max_staleness=1``: staleness 0 then 1 logged; step 0's rollout is
    the current weights' (within ``tol``), every later one the previous step's (within ``tol``)
    and more than ``moved`` away from the current weights'; nothing left submitted."""
    staleness = [row["rollout_staleness"] for row in result["rows"]]
    print(f"staleness {staleness}, |gen - now| {result['now']}, |gen - previous| "
          f"{result['previous']}")  # fmt: skip
    assert staleness == [0.0] + [1.0] * (steps - 1), staleness
    assert result["now"][0] < tol, result["now"]
    assert max(result["previous"]) < tol, result["previous"]
    assert min(result["now"][1:]) > moved, result["now"]
    assert result["queued"] == 0  # nothing submitted past max_steps
