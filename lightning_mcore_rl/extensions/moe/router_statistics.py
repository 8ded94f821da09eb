"""MoE router losses and statistics of one step (docs/training-step.md, "MoE")."""

# `RouterStatistics` sets each router call's loss coefficients so the router losses enter the
# loss once with megatron's per-token semantics, and fills per-layer counters `[L, width]` during
# the pass, summed over microbatches and every rank in one all-reduce at the step's end.

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mcore_rl.extensions.moe.router_replay import (
    moe_layer_numbers,
    sequence_parallel_slice,
)
from lightning_mcore_rl.parallel import ParallelGroups

ROUTER_LOSS_NAMES = (
    "load_balancing_loss",
    "seq_load_balancing_loss",
    "global_load_balancing_loss",
    "z_loss",
)
"""Megatron's names of the router losses (``moe_utils.save_to_aux_losses_tracker``), in the
order of ``moe_router_load_balancing_type`` ``aux_loss`` / ``seq_aux_loss`` /
``global_aux_loss``, then the z-loss."""


@dataclass(frozen=True)
class RouterCall:
    """One router forward (one MoE layer, one microbatch, this rank), as a counter sees it."""

    layer: int  # the layer's global 0-based index (megatron's `layer_number - 1`)
    router: torch.nn.Module
    hidden_states: Tensor  # the router input `[s, b, H]` (`s = S/CP/TP` under SP)
    padding_mask: Tensor | None  # megatron's routing padding mask `[s, b]` (True = padding)
    # the routing weights `[s*b, E]` (0 where a token is not routed or was dropped)
    probs: Tensor
    routing_map: Tensor  # `[s*b, E]` bool, the kept assignments (after capacity dropping)
    # this call's enabled router losses by name of `ROUTER_LOSS_NAMES`, as megatron tracked
    # them: no coefficient; the load-balancing ones are this rank's partial sum over its tokens,
    # the z-loss the mean over its tokens
    losses: Mapping[str, Tensor]
    # `n_mb`, the microbatch's routed tokens over its TP x CP ranks (training passes that scale
    # the router losses; `None` otherwise)
    microbatch_tokens: float | None = None
    # the batch's recorded routing of this layer `[s*b, K]` in the router's token order
    # (`routed_experts`, e.g. from the rollout), or `None`
    recorded: Tensor | None = None

    @property
    def valid(self) -> Tensor:
        """``[s*b]`` bool: the tokens that count (not padding), in the routers' token order."""
        if self.padding_mask is None:
            return torch.ones(self.probs.shape[0], dtype=torch.bool, device=self.probs.device)
        return ~self.padding_mask.bool().reshape(-1)

    @property
    def routed_tokens(self) -> Tensor:
        """``n_r``: tokens this call routes (non-padding ones with a padding mask), 0-d fp64."""
        return self.valid.sum().to(torch.float64)


@dataclass(frozen=True)
class StatsLayout:
    """What a statistic's metrics need besides its table: ``TP * CP`` (ranks that split one
    microbatch's tokens) and the routers' top-k."""

    tp_cp: int
    topk: int


@dataclass(frozen=True)
class RouterStatistic:
    """A per-layer counter and the step metrics derived from its table (summed over
    microbatches and every rank, MoE layers only)."""

    name: str  # unique in a `RouterStatistics`
    width: int | None  # values per layer; `None`: the number of experts `E`
    count: Callable[[RouterCall], Tensor]  # one router call's `[width]` contribution (summed)
    # `metrics(table [L_moe, width], layout) -> {metric: value}`
    metrics: Callable[[Tensor, StatsLayout], dict[str, float]]


def _kept(call: RouterCall) -> Tensor:
    """``[s*b, E]`` bool: the kept (token, expert) assignments of non-padding tokens (megatron
    routes padding tokens too; a dropped or padded-to-capacity slot has weight 0)."""
    return (call.probs != 0) & call.valid[:, None]


def _tokens_per_expert_count(call: RouterCall) -> Tensor:
    return _kept(call).sum(dim=0).to(torch.float64)  # [E]


def _tokens_per_expert_metrics(table: Tensor, _layout: StatsLayout) -> dict[str, float]:
    return {
        "moe/tokens_per_expert_max": float(table.max()),
        "moe/tokens_per_expert_mean": float(table.mean()),
    }


def _dropped_count(call: RouterCall) -> Tensor:
    kept = _kept(call).sum().to(torch.float64)
    return (call.routed_tokens * cast(int, call.router.topk) - kept).reshape(1)


def _dropped_metrics(table: Tensor, _layout: StatsLayout) -> dict[str, float]:
    return {"moe/dropped_tokens": float(table.sum())}


def _mismatch_count(call: RouterCall) -> Tensor:
    assert call.recorded is not None  # counted only when the batch carries a recorded routing
    recorded = torch.zeros_like(call.routing_map).scatter(1, call.recorded.long(), True)
    matched = (call.routing_map & recorded).sum(dim=1)  # [s*b]
    topk = cast(int, call.router.topk)
    valid = call.valid
    mismatched = (topk - matched)[valid].sum().to(torch.float64)
    return torch.stack([mismatched, valid.sum().to(torch.float64) * topk])


def _mismatch_metrics(table: Tensor, _layout: StatsLayout) -> dict[str, float]:
    total = float(table[:, 1].sum())
    return {"moe/router_mismatch_fraction": float(table[:, 0].sum()) / total if total else 0.0}


ROUTER_MISMATCH = RouterStatistic("router_mismatch", 2, _mismatch_count, _mismatch_metrics)
"""``moe/router_mismatch_fraction``: of the (token, layer, k) slots of the non-padding tokens,
the fraction the pass routed to another expert than the batch's recorded ``routed_experts``
(e.g. generation's); 0 under router replay. Counted only for batches that carry the key."""

TOKENS_PER_EXPERT = RouterStatistic(
    "tokens_per_expert", None, _tokens_per_expert_count, _tokens_per_expert_metrics
)
"""Kept (token, expert) assignments per expert and layer over the step: ``moe/tokens_per_expert_max``
(the busiest expert of any layer) and ``moe/tokens_per_expert_mean`` (over layers and experts)."""

DROPPED_TOKENS = RouterStatistic("dropped_tokens", 1, _dropped_count, _dropped_metrics)
"""``moe/dropped_tokens``: (token, expert) assignments removed by the capacity factor over the
step, all layers (``top-k * routed tokens - kept``; 0 without ``moe_expert_capacity_factor``)."""


def router_loss_statistic(name: str) -> RouterStatistic:
    """`moe/<name>`: the router loss `name` (no coefficient) as it entered the step's loss,
    averaged over the MoE layers: per layer `sum_mb (n_mb / N) * loss_mb`."""
    # load-balancing losses are per-rank partials (sum_r aux_r = aux_mb), counted as
    # [n_mb * aux_r, n_mb]: the summed table gives TP*CP * sum / sum; the z-loss is a per-rank
    # token mean, counted as [n_r * z_r, n_r]: the token-weighted mean sum / sum
    partial = name != "z_loss"

    def count(call: RouterCall) -> Tensor:
        n = call.routed_tokens
        if partial:
            assert (
                call.microbatch_tokens is not None
            )  # losses are only scaled and counted in training
            n = torch.tensor(call.microbatch_tokens, dtype=torch.float64, device=n.device)
        return torch.stack([n * call.losses[name].to(torch.float64), n])

    def metrics(table: Tensor, layout: StatsLayout) -> dict[str, float]:
        per_layer = table[:, 0] / table[:, 1] * (layout.tp_cp if partial else 1)
        return {f"moe/{name}": float(per_layer.mean())}

    return RouterStatistic(name, 2, count, metrics)


def moe_config(chunks: Sequence[torch.nn.Module]) -> Any:
    """The chunks' megatron config when the model has MoE layers, else ``None``."""
    from megatron.core.utils import get_model_config

    config = get_model_config(chunks[0])
    return config if getattr(config, "num_moe_experts", None) else None


def enabled_router_losses(config: Any) -> tuple[str, ...]:
    """The router losses megatron computes in training for ``config`` (names of
    `ROUTER_LOSS_NAMES`)."""
    types = config.moe_router_load_balancing_type
    coeffs = config.moe_aux_loss_coeff
    types = [types] if isinstance(types, str) else list(types)
    coeffs = [coeffs] * len(types) if isinstance(coeffs, (int, float)) else list(coeffs)
    kinds: dict[str, float] = {}
    for kind, coeff in zip(types, coeffs, strict=True):
        # megatron's Router.get_aux_loss_coeff looks a type up with list.index: the first wins
        kinds.setdefault(kind, coeff)
    names = [
        loss
        for kind, loss in zip(
            ("aux_loss", "seq_aux_loss", "global_aux_loss"), ROUTER_LOSS_NAMES[:3], strict=True
        )
        if kinds.get(kind, 0) > 0
    ]
    if config.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return tuple(names)


def microbatch_tokens(microbatches: Sequence[Any], groups: ParallelGroups) -> list[float]:
    """`n_mb` of this rank's microbatches: the tokens megatron's routers route for each (over
    its TP and CP ranks)."""
    # the model ids' positions, or the non-padding ones of the routing `padding_mask` (True =
    # padding), times CP (a CP rank holds `1/CP` of them)
    counts = []
    for mb in microbatches:
        mask = mb.padding_mask
        local = mb.input_ids_cp_sharded.numel() if mask is None else int((~mask.bool()).sum())
        counts.append(float(local * groups.cp_size))
    return counts


@dataclass(frozen=True)
class RouterLossScale:
    """What the router-loss coefficients of one training pass are derived from."""

    microbatch_tokens: Sequence[float]  # `n_mb` of this rank's microbatches, in schedule order
    total_tokens: float  # `N`: `n_mb` summed over the global batch (all microbatches, DP ranks)
    tp_cp: int  # `TP * CP`, the ranks that split one microbatch's tokens

    @classmethod
    def of(
        cls, microbatches: Sequence[Any], groups: ParallelGroups, device: torch.device | str
    ) -> RouterLossScale:
        """From the pass's processed microbatches (``N``: ONE all-reduce over DP)."""
        counts = microbatch_tokens(microbatches, groups)
        total = torch.tensor(sum(counts), dtype=torch.float64, device=device)
        if groups.dp_size > 1:
            dist.all_reduce(total, group=groups.dp_group)
        return cls(counts, float(total), groups.tp_size * groups.cp_size)


@dataclass
class RouterStatistics:
    """The step's router counters (and, in training, the router-loss coefficients).

    Hooks on every router of `chunks` inside `collect`, one all-reduce in `reduce`.
    """

    chunks: Sequence[torch.nn.Module]  # their routers are found by type
    statistics: Sequence[RouterStatistic]  # what is counted (e.g. `default_statistics`)
    # the router losses' scale (a training pass with `calculate_per_token_loss`); `None`:
    # coefficients left as configured
    scale: RouterLossScale | None = None
    device: torch.device | str = "cpu"  # where the tables live (the collectives' device)
    # per microbatch (schedule order), the recorded routing `[n, L, K]` in the routers' token
    # order (this rank's SP slice; L = the model's MoE layers) or `None`; empty: none recorded
    recorded: Sequence[Tensor | None] = ()
    _tables: dict[str, Tensor] = field(default_factory=dict, init=False)
    _before: dict[str, Tensor] = field(default_factory=dict, init=False)
    _calls: dict[int, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        from megatron.core.utils import get_model_config

        names = [s.name for s in self.statistics]
        if len(set(names)) != len(names):
            raise ValueError(f"`statistics` names must be unique, got {names}")
        config = moe_config(self.chunks)
        if config is None:
            raise ValueError("RouterStatistics needs model chunks with MoE layers")
        self._config = config
        self._configs = list({id(c): c for c in map(get_model_config, self.chunks)}.values())
        self._coefficients = [(c, c.moe_aux_loss_coeff, c.moe_z_loss_coeff) for c in self._configs]
        for stat in self.statistics:
            width = config.num_moe_experts if stat.width is None else stat.width
            self._tables[stat.name] = torch.zeros(
                config.num_layers, width, dtype=torch.float64, device=self.device
            )

    def _routers(self) -> list[torch.nn.Module]:
        from megatron.core.transformer.moe.router import Router

        return [m for chunk in self.chunks for m in chunk.modules() if isinstance(m, Router)]

    @contextlib.contextmanager
    def collect(self) -> Iterator[None]:
        """Count every router forward inside the block; the configured coefficients are
        restored on exit, also on error."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        # cleared first: each call's losses are the tracker's increments
        clear_aux_losses_tracker()
        handles = []
        for router in self._routers():
            handles.append(router.register_forward_pre_hook(self._before_call))
            handles.append(router.register_forward_hook(self._count))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            for config, aux, z in self._coefficients:
                config.moe_aux_loss_coeff, config.moe_z_loss_coeff = aux, z

    def coefficients(self, microbatch: int, multiplier: float) -> tuple[Any, float | None]:
        """`(moe_aux_loss_coeff, moe_z_loss_coeff)` for one router call of `microbatch` whose
        load-balancing loss megatron multiplies by `multiplier` (`_multiplier`)."""
        # the one place of the router losses' scaling
        assert self.scale is not None  # only called with a scale
        _, aux, z = self._coefficients[0]
        # per router call megatron (calculate_per_token_loss) back-propagates c' * m * aux_r
        # (c' the coefficient at forward time, m the multiplier, aux_r this rank's partial
        # load-balancing loss: sum_r aux_r = aux_mb over the TP x CP ranks) and, for the z-loss,
        # c'_z / (TP*CP) * n_r * mean_r(lse^2); DDP and the SP/CP gradient reductions SUM over
        # TP, CP and DP without rescaling. So c' = c * n_mb / (N * m) gives
        # c * sum_mb (n_mb / N) * aux_mb, and c'_z = c_z * TP*CP / N gives
        # c_z * sum over routed tokens of lse^2 / N. Megatron reads the coefficients at every
        # router forward (TopKRouter.get_aux_loss_coeff, apply_z_loss) and divides its tracked
        # values by them again: its loss tracker keeps the unscaled losses
        weight = self.scale.microbatch_tokens[microbatch] / (self.scale.total_tokens * multiplier)
        scaled = aux * weight if isinstance(aux, (int, float)) else [a * weight for a in aux]
        return scaled, None if z is None else z * self.scale.tp_cp / self.scale.total_tokens

    def _multiplier(self, hidden: Tensor, mask: Tensor | None, microbatch: int) -> float:
        """The token count megatron 0.16 multiplies a call's load-balancing loss by: the call's
        tokens `s x b` without a padding mask, `n_mb` with one."""
        assert self.scale is not None  # only called with a scale
        if mask is None:
            return float(hidden.shape[0] * hidden.shape[1])
        # its local_num_tokens is meant to be this rank's non-padding tokens, but
        # moe_utils.get_tokens_per_expert_and_token_count all-reduces local_tokens_per_expert
        # over TP x CP in place before summing it: it is the microbatch's (2x the gradient at
        # TP=2 otherwise)
        return max(self.scale.microbatch_tokens[microbatch], 1.0)

    def _tracked(self) -> dict[str, Tensor]:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        return {k: v["values"] for k, v in tracker.items() if k in ROUTER_LOSS_NAMES}

    def _call(self, router: torch.nn.Module, args: Any) -> tuple[int, int, Tensor | None]:
        """``(layer, microbatch, padding_mask)`` of a router call (a layer's k-th call in a pass
        is microbatch k: every schedule runs a chunk's microbatches in order)."""
        layer = int(cast(int, router.layer_number)) - 1
        mask = args[1] if len(args) > 1 else None
        return layer, self._calls.get(layer, 0), mask

    def _before_call(self, router: torch.nn.Module, args: Any) -> None:
        layer, microbatch, mask = self._call(router, args)
        self._before = {k: v[layer].clone() for k, v in self._tracked().items()}
        if self.scale is not None:
            aux, z = self.coefficients(microbatch, self._multiplier(args[0], mask, microbatch))
            for config in self._configs:
                config.moe_aux_loss_coeff, config.moe_z_loss_coeff = aux, z

    @torch.no_grad()
    def _count(self, router: torch.nn.Module, args: Any, output: Any) -> None:
        layer, microbatch, mask = self._call(router, args)
        self._calls[layer] = microbatch + 1
        losses = {
            k: v[layer] - self._before.get(k, torch.zeros((), device=v.device))
            for k, v in self._tracked().items()
        }
        probs, routing_map = output
        tokens = None if self.scale is None else self.scale.microbatch_tokens[microbatch]
        recorded = self.recorded[microbatch] if microbatch < len(self.recorded) else None
        if recorded is not None:
            recorded = recorded[:, moe_layer_numbers(self._config).index(layer + 1)]
        call = RouterCall(
            layer=layer, router=router, hidden_states=args[0], padding_mask=mask,
            probs=probs.detach(), routing_map=routing_map, losses=losses,
            microbatch_tokens=tokens, recorded=recorded,
        )  # fmt: skip
        for stat in self.statistics:
            self._tables[stat.name][layer] += stat.count(call).to(self.device)

    def reduce(self, groups: ParallelGroups, world_group: Any = None) -> dict[str, Tensor]:
        """Every table summed over all ranks (ONE all-reduce over `world_group`, `None`: the
        default group), then each statistic's metrics; identical on every rank."""
        # metrics cover the MoE layers only: the rows some router filled
        names = [s.name for s in self.statistics]
        flat = torch.cat([self._tables[n].reshape(-1) for n in names])
        if dist.is_initialized() and dist.get_world_size(world_group) > 1:
            dist.all_reduce(flat, group=world_group)
        sizes = [self._tables[n].numel() for n in names]
        layers = self._config.num_layers
        tables = {
            n: t.reshape(layers, -1) for n, t in zip(names, flat.cpu().split(sizes), strict=True)
        }
        seen = torch.stack([t.abs().sum(-1) > 0 for t in tables.values()]).any(0)
        layout = StatsLayout(groups.tp_size * groups.cp_size, self._config.moe_router_topk)
        metrics: dict[str, float] = {}
        for stat in self.statistics:
            metrics.update(stat.metrics(tables[stat.name][seen], layout))
        return {k: torch.tensor(v, dtype=torch.float32) for k, v in metrics.items()}


def default_statistics(config: Any, losses: bool, recorded: bool = False) -> list[RouterStatistic]:
    """Tokens per expert and dropped tokens, plus every enabled router loss (`losses`) and the
    routing mismatch (`recorded`)."""
    # `losses`: a pass that scales them; `recorded`: the batch carries `routed_experts`
    stats = [TOKENS_PER_EXPERT, DROPPED_TOKENS]
    if losses:
        stats += [router_loss_statistic(name) for name in enabled_router_losses(config)]
    if recorded:
        stats.append(ROUTER_MISMATCH)
    return stats


def recorded_routing_per_microbatch(
    microbatches: Sequence[Any], groups: ParallelGroups, sequence_parallel: bool
) -> list[Tensor | None]:
    """Each microbatch's ``routed_experts_cp_sharded`` ``[N, L, K]`` as this rank's routers see
    it (the SP slice of the tokens), ``None`` where absent."""
    tp = groups.tp_size if sequence_parallel else 1
    return [
        None
        if mb.routed_experts_cp_sharded is None
        else sequence_parallel_slice(mb.routed_experts_cp_sharded, groups.tp_rank, tp)
        for mb in microbatches
    ]


@contextlib.contextmanager
def moe_pass(
    chunks: Sequence[torch.nn.Module],
    microbatches: Sequence[Any],
    groups: ParallelGroups,
    *,
    training: bool,
    device: torch.device | str = "cpu",
) -> Iterator[RouterStatistics | None]:
    """The block of one pass of a MoE model: `default_statistics` collected and, in training,
    the router losses scaled; yields `None` (and does nothing) for a dense model.

    `microbatches`: the pass's processed microbatches (`input_ids_cp_sharded`, `padding_mask`,
    `routed_experts_cp_sharded`), in schedule order.
    """
    config = moe_config(chunks)
    if config is None:
        yield None
        return
    scale = None
    # megatron computes router losses in forward-backward passes only, and scales them per token
    # only with `calculate_per_token_loss`
    if training and config.calculate_per_token_loss and enabled_router_losses(config):
        scale = RouterLossScale.of(microbatches, groups, device)
    recorded = recorded_routing_per_microbatch(microbatches, groups, config.sequence_parallel)
    any_recorded = any(r is not None for r in recorded)
    stats = RouterStatistics(
        chunks, default_statistics(config, scale is not None, any_recorded), scale, device,
        recorded,
    )  # fmt: skip
    with stats.collect():
        yield stats


__all__ = [
    "DROPPED_TOKENS",
    "ROUTER_LOSS_NAMES",
    "ROUTER_MISMATCH",
    "TOKENS_PER_EXPERT",
    "RouterCall",
    "RouterStatistic",
    "RouterStatistics",
    "StatsLayout",
    "default_statistics",
    "enabled_router_losses",
    "moe_config",
    "moe_pass",
    "RouterLossScale",
    "microbatch_tokens",
    "recorded_routing_per_microbatch",
    "router_loss_statistic",
]
