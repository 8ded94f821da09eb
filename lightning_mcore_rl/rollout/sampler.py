"""Autoregressive sampling with the megatron training model itself, for toy tasks and tests on
CPU (no CP, SP or virtual pipelining: a production setup uses an inference engine)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mcore_rl.ops import TrainingSamplingParams, apply_top_k_top_p


class GenerationOutput(NamedTuple):
    """Prompts plus sampled completions, each ``[B, P+N]``: ``logprobs`` of the sampled tokens
    (0 at prompts); ``routed_experts [B, P+N, L, K]``: top-``K`` experts per MoE layer/``None``."""

    tokens: Tensor
    logprobs: Tensor
    completion_mask: Tensor
    routed_experts: Tensor | None = None


class _RoutingRecorder:
    """Hooks on this chunk's routers: per MoE layer the ``[B, s, K]`` expert ids of each forward."""

    def __init__(self, model: torch.nn.Module, batch: int) -> None:
        from megatron.core.transformer.moe.router import Router

        self.batch = batch
        self.calls: dict[int, list[Tensor]] = {}
        self.handles = [
            m.register_forward_hook(self._hook) for m in model.modules() if isinstance(m, Router)
        ]

    def _hook(self, router: torch.nn.Module, _args: Any, output: Any) -> None:
        routing_map = output[1]  # [s*B, E] bool, sequence-first tokens
        topk = int(router.topk)  # type: ignore[arg-type]
        # a token's routed experts are the ones set in its row of the 0/1 map
        ids = routing_map.float().topk(topk, dim=1).indices.sort(dim=1).values
        per_row = ids.view(-1, self.batch, topk).transpose(0, 1)  # [B, s, K]
        self.calls.setdefault(int(router.layer_number), []).append(per_row)  # type: ignore[arg-type]

    def routing(self, cached: bool) -> dict[int, Tensor]:
        """``{layer number: [B, P+N, K]}``: the cached forwards' new tokens in order, or the last
        uncached forward."""
        return {
            layer: torch.cat(calls, dim=1) if cached else calls[-1]
            for layer, calls in self.calls.items()
        }

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _gather_routing(local: dict[int, Tensor], pp_group: Any) -> Tensor:
    """Every stage's ``{layer number: [B, T, K]}`` -> ``[B, T, L, K]`` in layer order."""
    # each stage records only its own layers
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
    """A megatron ``StaticInferenceContext`` for ``batch`` rows of ``length`` tokens or ``None``."""
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
    """``ValueError`` unless every token routes to exactly top-k experts (MoE, no capacity)."""
    if not getattr(config, "num_moe_experts", None):
        raise ValueError("`record_routing=True` needs a model with MoE layers; this one has none")
    # a capacity factor may drop a token's slot, which then has no expert to record
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
    """This stage's chunk on ``ids [B, s]``: the last position's ``[B, V]`` logits on the last
    stage, ``None`` on the others."""
    # the stages run in turn, with blocking p2p of the hidden states [s, B, H]
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
    """Draw one token per row of ``logits [B, V]`` from ``softmax(filter(logits / temperature))``:
    ``(tokens [B, 1]`` int64, ``logprobs [B, 1]`` fp32 of the filtered distribution``)``."""
    scaled = logits.float() / temperature
    # vLLM's filter, top-k then top-p: what the trainer's TrainingSamplingParams reproduce
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
    """Sample ``max_new_tokens`` (``N``) tokens after each of ``prompts [B, P]`` (equal lengths).

    Args:
        model: a megatron GPT chunk (or its wrapper) returning logits ``[B, L, V/TP]``.
        generator: CPU generator: seed it alike on one TP group's ranks, differently across DP.
        pp_group: every stage calls ``generate`` with its chunk and the same prompts.
        kv_cache: cache keys/values in a ``StaticInferenceContext``.
        record_routing: a MoE model: fill ``GenerationOutput.routed_experts``.

    Raises:
        ValueError: bad prompts or sampling parameters, or an unsupported model."""
    if prompts.ndim != 2 or prompts.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"`prompts` must be integer [B, P], got {prompts.dtype} {tuple(prompts.shape)}"
        )
    if max_new_tokens < 1:
        raise ValueError(f"`max_new_tokens` must be >= 1, got {max_new_tokens}")
    # temperature > 0 divides the logits; top-k/top-p filter after it, and the logprobs are those
    # of the filtered distribution
    TrainingSamplingParams(temperature, top_k, top_p)  # checks the three
    _check_model_config(model, pp_group)
    if record_routing:
        _check_recordable(getattr(model, "config", None))
    was_training = model.training
    model.eval()  # no dropout while sampling; the training mode is restored below
    recorder = _RoutingRecorder(model, prompts.shape[0]) if record_routing else None
    try:
        tokens = prompts.long()
        logprobs = torch.zeros(prompts.shape, dtype=torch.float32)
        # Without a cache every new token re-runs the whole prefix (fine at tens of tokens); with
        # one, a prefill then one token per forward, and megatron gathers the logits over TP.
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
            # TP ranks draw from the same gathered logits with identically seeded generators, so
            # they agree on every token without communicating it
            if full is not None:  # the last stage draws
                nxt, picked = draw_tokens(full, generator, temperature, top_k, top_p)
            # the other stages need the token for their next forward
            if pp_group is not None and dist.get_world_size(pp_group) > 1:
                last = dist.get_process_group_ranks(pp_group)[-1]
                dist.broadcast(nxt, src=last, group=pp_group)
                dist.broadcast(picked, src=last, group=pp_group)
            tokens = torch.cat([tokens, nxt], dim=1)
            logprobs = torch.cat([logprobs, picked], dim=1)
        routed = None
        # the last sampled token's routing needs one more forward (tokens and logprobs unchanged)
        if recorder is not None:
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
