"""Autoregressive sampling with the megatron training model itself.

Meant for toy tasks and tests on CPU: by default every new token re-runs the model on the whole
prefix, which is fine at tens of tokens; ``kv_cache=True`` keeps the keys and values in megatron's
``StaticInferenceContext`` instead (one prefill, then one token per forward). Tensor-parallel ranks gather the vocab-sharded logits and
draw with identically seeded generators, so they agree on every token without communicating the
samples. With a ``pp_group`` every pipeline stage runs its chunk in turn (blocking p2p of the
hidden states ``[s, B, H]``), the last stage draws, and the token is broadcast to the other stages.
Context parallelism, sequence parallelism and virtual pipelining are not supported here; a
production setup uses an inference engine instead.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mcore_rl.ops import TrainingSamplingParams, apply_top_k_top_p


class GenerationOutput(NamedTuple):
    """Prompts plus sampled completions.

    Attributes:
        tokens: ``[B, P+N]`` prompt then ``N`` sampled tokens.
        logprobs: ``[B, P+N]`` log-probability of each sampled token under the (temperature-scaled)
            sampling distribution; 0 at prompt positions (stored-logprob convention).
        completion_mask: ``[B, P+N]`` 1 at sampled positions, 0 at prompt positions.
        routed_experts: ``[B, P+N, L, K]`` with ``record_routing``: the experts each position
            was routed to at each of the model's ``L`` MoE layers (top-``K``, ascending ids; the
            batch key ``routed_experts`` of router replay), else ``None``.
    """

    tokens: Tensor
    logprobs: Tensor
    completion_mask: Tensor
    routed_experts: Tensor | None = None


class _RoutingRecorder:
    """Forward hooks on this chunk's megatron routers: per MoE layer (global layer number) the
    ``[B, s, K]`` expert ids of every forward, from the router's ``routing_map [s*B, E]``
    (sequence-first tokens)."""

    def __init__(self, model: torch.nn.Module, batch: int) -> None:
        from megatron.core.transformer.moe.router import Router

        self.batch = batch
        self.calls: dict[int, list[Tensor]] = {}
        self.handles = [
            m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, Router)
        ]

    def _hook(self, router: torch.nn.Module, _args: Any, output: Any) -> None:
        routing_map = output[1]  # [s*B, E] bool
        topk = int(router.topk)  # type: ignore[arg-type]
        ids = routing_map.float().topk(topk, dim=1).indices.sort(dim=1).values
        per_row = ids.view(-1, self.batch, topk).transpose(0, 1)  # [B, s, K]
        self.calls.setdefault(int(router.layer_number), []).append(per_row)  # type: ignore[arg-type]

    def routing(self, cached: bool) -> dict[int, Tensor]:
        """``{layer number: [B, P+N, K]}``: with a KV cache the forwards' new tokens in order,
        without one the last forward (it ran the whole sequence)."""
        return {
            layer: torch.cat(calls, dim=1) if cached else calls[-1]
            for layer, calls in self.calls.items()
        }

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _gather_routing(local: dict[int, Tensor], pp_group: Any) -> Tensor:
    """Every stage's ``{layer number: [B, T, K]}`` -> ``[B, T, L, K]`` in layer order (one
    ``all_gather_object`` over the pipeline group when PP > 1)."""
    parts = [local]
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        parts = [{} for _ in range(dist.get_world_size(pp_group))]
        dist.all_gather_object(parts, local, group=pp_group)
    merged = {layer: ids for part in parts for layer, ids in part.items()}
    return torch.stack([merged[layer] for layer in sorted(merged)], dim=2)


def _full_vocab_logits(local: Tensor, tp_group: Any) -> Tensor:
    """``[B, V/TP]`` local shard -> ``[B, V]`` on every TP rank (identical bits everywhere)."""
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, local.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def _kv_context(batch: int, length: int, enabled: bool) -> Any:
    """A megatron ``StaticInferenceContext`` for ``batch`` rows of up to ``length`` tokens, or
    ``None`` without a KV cache."""
    if not enabled:
        return None
    from megatron.core.inference.contexts import StaticInferenceContext

    return StaticInferenceContext(batch, length)


def _check_model_config(model: torch.nn.Module, pp_group: Any) -> None:
    config = getattr(model, "config", None)
    if config is None:
        return
    pp = 1 if pp_group is None else dist.get_world_size(pp_group)
    if getattr(config, "pipeline_model_parallel_size", 1) != pp:
        raise ValueError(
            f"generate() got a model with pipeline_model_parallel_size="
            f"{config.pipeline_model_parallel_size} and a `pp_group` of size {pp}; pass the "
            "model's pipeline-parallel group as `pp_group`."
        )
    unsupported = {
        "context_parallel_size": getattr(config, "context_parallel_size", 1),
        "virtual_pipeline_model_parallel_size": getattr(
            config, "virtual_pipeline_model_parallel_size", None
        )
        or 1,
    }
    for name, size in unsupported.items():
        if size != 1:
            raise ValueError(f"generate() runs one unsharded chunk per stage; got {name}={size}")
    if getattr(config, "sequence_parallel", False):
        raise ValueError("generate() does not support sequence_parallel=True models")


def _check_recordable(config: Any) -> None:
    """``record_routing`` needs MoE layers that route every token to exactly top-k experts.

    Raises:
        ValueError: a dense model, or a capacity factor (a dropped slot has no expert to record).
    """
    if not getattr(config, "num_moe_experts", None):
        raise ValueError("`record_routing=True` needs a model with MoE layers; this one has none")
    capacity = getattr(config, "moe_expert_capacity_factor", None)
    if capacity is not None:
        raise ValueError(
            f"`record_routing=True` records top-k experts per token, but "
            f"`moe_expert_capacity_factor={capacity}` may drop some of them; generate without "
            "a capacity factor."
        )


def _last_logits(
    model: torch.nn.Module,
    ids: Tensor,
    positions: Tensor,
    context: Any,
    tp_group: Any,
    pp_group: Any,
) -> Tensor | None:
    """Run this stage's chunk on ``ids [B, s]``: ``[B, V]`` full-vocab logits of the last
    position on the last pipeline stage, ``None`` on the others (which send their hidden
    states ``[s, B, H]`` on)."""
    ranks, stage = [0], 0
    if pp_group is not None:
        ranks = dist.get_process_group_ranks(pp_group)
        stage = ranks.index(dist.get_rank())
    if stage > 0:
        from lightning_mcore_rl.parallel import unwrap_model as unwrap

        core = unwrap(model)
        config: Any = core.config
        hidden = torch.empty(
            ids.shape[1], ids.shape[0], config.hidden_size, dtype=config.params_dtype
        )
        dist.recv(hidden, ranks[stage - 1])
        core.set_input_tensor(hidden)  # type: ignore[operator]
    if context is None:
        out = model(ids, positions, None)
    else:
        out = model(ids, positions, None, inference_context=context, runtime_gather_output=True)
    if stage < len(ranks) - 1:
        dist.send(out.contiguous(), ranks[stage + 1])
        return None
    last = out[:, -1, :].float()  # [B, V/TP], or [B, V] gathered by megatron with a context
    return last if context is not None else _full_vocab_logits(last, tp_group)


@torch.no_grad()
def draw_tokens(
    logits: Tensor,
    generator: torch.Generator,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Draw one token per row from ``softmax(filter(logits / temperature))``, the filter vLLM's
    top-k then top-p (:func:`~lightning_mcore_rl.ops.apply_top_k_top_p`, what the trainer's
    ``TrainingSamplingParams`` reproduce).

    Args:
        logits: ``[B, V]`` full-vocabulary logits.
        generator: the draw's CPU generator.
        temperature, top_k, top_p: as :class:`~lightning_mcore_rl.ops.TrainingSamplingParams`.

    Returns:
        ``(tokens [B, 1]`` int64, ``logprobs [B, 1]`` fp32 under the filtered distribution``)``.
    """
    scaled = logits.float() / temperature
    if top_k is not None or top_p < 1.0:
        scaled, _ = apply_top_k_top_p(scaled, top_k, top_p)
    log_probs = torch.log_softmax(scaled, dim=-1)  # [B, V]
    tokens = torch.multinomial(log_probs.exp(), 1, generator=generator)  # [B, 1]
    return tokens, log_probs.gather(1, tokens)


def generate(
    model: torch.nn.Module,
    prompts: Tensor,
    *,
    max_new_tokens: int,
    generator: torch.Generator,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    tp_group: Any = None,
    pp_group: Any = None,
    kv_cache: bool = False,
    record_routing: bool = False,
) -> GenerationOutput:
    """Sample ``max_new_tokens`` tokens after each prompt.

    Args:
        model: a megatron GPT chunk (or its DDP/Float16 wrapper) returning vocab-parallel logits
            ``[B, L, V/TP]`` for ``model(input_ids, position_ids, attention_mask=None)``.
        prompts: ``[B, P]`` token ids (equal-length prompts).
        max_new_tokens: ``N`` >= 1.
        generator: CPU generator; seed it identically on the ranks of one TP group and differently
            across data-parallel ranks.
        temperature: > 0; logits are divided by it before sampling.
        top_k, top_p: vLLM's filters after the temperature (:func:`draw_tokens`); the
            logprobs are those of the filtered distribution.
        tp_group: tensor-parallel group (``None`` or size 1: logits are already full-vocab).
        pp_group: pipeline-parallel group (``None``: PP=1); every stage calls ``generate`` with
            its chunk and the same prompts, and all get the same output.
        kv_cache: cache keys/values in a megatron ``StaticInferenceContext`` (megatron then
            gathers the logits over TP itself); same tokens as without, logprobs within fp32
            rounding.
        record_routing: a MoE model: record every position's experts per MoE layer
            (``GenerationOutput.routed_experts``), the routing each generation forward made;
            one more forward routes the last sampled token. The sampled tokens and logprobs
            are unchanged.

    Returns:
        :class:`GenerationOutput`.
    """
    if prompts.ndim != 2 or prompts.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"`prompts` must be integer [B, P], got {prompts.dtype} {tuple(prompts.shape)}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be >= 1, got {max_new_tokens}")
    TrainingSamplingParams(temperature, top_k, top_p)  # checks the three
    _check_model_config(model, pp_group)
    if record_routing:
        _check_recordable(getattr(model, "config", None))
    was_training = model.training
    model.eval()
    recorder = _RoutingRecorder(model, prompts.shape[0]) if record_routing else None
    try:
        tokens = prompts.long()
        logprobs = torch.zeros(prompts.shape, dtype=torch.float32)
        context = _kv_context(tokens.shape[0], tokens.shape[1] + max_new_tokens, kv_cache)
        for _ in range(max_new_tokens):
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)
            fresh = tokens.shape[1] - (0 if context is None else context.sequence_len_offset)
            # without a cache the whole prefix; with one only the tokens not yet cached
            full = _last_logits(
                model, tokens[:, -fresh:], positions[:, -fresh:], context, tp_group, pp_group
            )
            if context is not None:
                context.increment_sequence_len_offset(fresh)
            nxt = torch.empty(tokens.shape[0], 1, dtype=torch.long)
            picked = torch.empty(tokens.shape[0], 1, dtype=torch.float32)
            if full is not None:  # the last stage draws
                nxt, picked = draw_tokens(full, generator, temperature, top_k, top_p)
            if pp_group is not None and dist.get_world_size(pp_group) > 1:
                last = dist.get_process_group_ranks(pp_group)[-1]
                dist.broadcast(nxt, src=last, group=pp_group)
                dist.broadcast(picked, src=last, group=pp_group)
            tokens = torch.cat([tokens, nxt], dim=1)
            logprobs = torch.cat([logprobs, picked], dim=1)
        routed = None
        if recorder is not None:  # the last sampled token's routing: one more forward
            fresh = tokens.shape[1] - (0 if context is None else context.sequence_len_offset)
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)
            _last_logits(
                model, tokens[:, -fresh:], positions[:, -fresh:], context, tp_group, pp_group
            )
            routed = _gather_routing(recorder.routing(cached=context is not None), pp_group)
    finally:
        if recorder is not None:
            recorder.remove()
        model.train(was_training)
    mask = torch.zeros_like(tokens)
    mask[:, prompts.shape[1] :] = 1
    return GenerationOutput(tokens, logprobs, mask, routed)
