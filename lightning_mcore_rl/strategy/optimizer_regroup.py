"""Resuming a megatron optimizer's state under another expert-parallel size (EP): `load_template`
asks `dist_checkpointing` for this run's tensors under the keys the checkpoint stores them at,
`current_state` puts them, the saved step and group hyper-parameters into this run's structure
(exact: every number copied, none recomputed)."""

# megatron-core 0.16's `get_megatron_optimizer` returns a `ChainedOptimizer` whose members split
# the parameters by `allreduce`, which expert layers set to False only when EP > 1:
#   EP = 1: ONE member holds every parameter; `ChainedOptimizer` passes its state through:
#       {"state": {"common_step": step}, "param_groups": [g_wd, g_no_wd]}   # in common.pt
#       optimizer.state.exp_avg.<model key>                                # shards
#   EP > 1: TWO members, dense (0) and experts (1, expert model/data-parallel groups), keyed per
#   member with the `chained_<i>.` prefix (megatron adds it unless `chained_optim_avoid_prefix`,
#   which this package never sets):
#       {0: {"state": ..., "param_groups": [g_wd, g_no_wd]},
#        1: {"state": ..., "param_groups": [g_wd(is_expert_parallel=True)]}}
#       chained_0.optimizer.state.exp_avg.<dense key>
#       chained_1.optimizer.state.exp_avg.<expert key>
# The per-parameter tensors are the same in both (under global model keys independent of EP);
# only the prefix, the nesting of the common part and the groups' split differ. A map at load
# rather than one structure for every EP: the split is decided inside megatron's expert layers
# and consumed by its DDP and optimizer, so forcing it at EP = 1 would patch attributes megatron
# owns, and EP = 1 checkpoints already exist in the other format.

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

REGROUPED = "mcore_rl_regrouped"
"""Key under which :func:`load_template` puts this run's tensors, beside the saved common part."""

_CHAIN_PREFIX = re.compile(r"^chained_\d+\.")

_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs")
"""torch LR-scheduler state entries with one value per parameter group."""


def load_template(
    optimizer: Any, model_state: Mapping[str, Any], saved_keys: Collection[str]
) -> dict[str, Any]:
    """This run's (not distributed) optimizer state as a sharded load template
    `{REGROUPED: {member index: template}}`: each member's `sharded_state_dict` with each tensor
    renamed to the key in `saved_keys` (`load_tensors_metadata`) that equals it up to a
    `chained_<i>.` prefix; `dist_checkpointing.load` merges it beside the saved common part."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    prefixes = sorted({m.group(0) for k in saved_keys if (m := _CHAIN_PREFIX.match(k))} | {""})
    members: dict[int, Any] = {}
    for i, member in enumerate(_members(optimizer)):
        state = member.sharded_state_dict(model_state, is_loading=True)
        for item in nested_values(state):
            if isinstance(item, ShardedBase):
                item.key = _saved_prefix(item, prefixes, saved_keys) + item.key
        members[i] = state
    return {REGROUPED: members}


def _saved_prefix(item: Any, prefixes: Sequence[str], saved_keys: Collection[str]) -> str:
    """The chain prefix under which the checkpoint stores every tensor `item` stands for."""
    # a `ShardedTensorFactory` stores the tensors it builds (e.g. a GLU weight's `_w`/`_v`)
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensorFactory

    if isinstance(item, ShardedTensorFactory):
        built = item.build()
        keys = [t.key for t in nested_values(built) if isinstance(t, ShardedBase)]
    else:
        keys = [item.key]
    found = [p for p in prefixes if all(p + key in saved_keys for key in keys)]
    if len(found) != 1:
        raise KeyError(
            f"The checkpoint stores optimizer tensor {item.key!r} under "
            f"{'no' if not found else 'more than one'} chained-optimizer prefix "
            f"({', '.join(repr(p) for p in found) or 'tried ' + ', '.join(map(repr, prefixes))})."
        )
    return found[0]


def current_state(loaded: Mapping[str, Any], optimizer: Any) -> tuple[Any, list[int]]:
    """`loaded` (`checkpoint["optimizer_states"][0]` of a `load_template` load) as the state
    `optimizer.load_state_dict` takes, and for each of this run's parameter groups the index of
    the saved group it took.

    Raises:
        ValueError: the saved members' steps differ; no saved group matches one of this run's;
            or saved groups merged into one group of this run have different hyper-parameters."""
    # each group takes the saved group of the same (wd_mult, lr_mult, is_decoupled_lr) (megatron's
    # identity without is_expert_parallel, which EP decides), is_expert_parallel set to this run's
    regrouped = loaded[REGROUPED]
    saved = {k: v for k, v in loaded.items() if k != REGROUPED}
    saved_members = [saved[k] for k in sorted(saved)] if all(isinstance(k, int) for k in saved) \
        else [saved]  # fmt: skip
    saved_groups = [g for m in saved_members for g in _inner(m)["param_groups"]]
    step = _common_step([_inner(m)["state"] for m in saved_members])
    states, group_map = [], []
    for i, member in enumerate(_members(optimizer)):
        state = regrouped[i]
        inner = _inner(state)
        if step is not None:
            inner["state"]["common_step"] = step
        groups = []
        for current, loaded_group in zip(member.optimizer.param_groups, inner["param_groups"],
                                         strict=True):  # fmt: skip
            j = _saved_group(current, saved_groups)
            group_map.append(j)
            groups.append({**saved_groups[j], "params": loaded_group["params"],
                           "is_expert_parallel": current["is_expert_parallel"]})  # fmt: skip
        inner["param_groups"] = groups
        states.append(state)
    return (states[0] if len(states) == 1 else dict(enumerate(states))), group_map


def scheduler_state(state: Mapping[str, Any], group_map: Sequence[int]) -> dict[str, Any]:
    """A torch LR scheduler's `state` with its per-group lists (nested `_schedulers`' too)
    reordered by `group_map` (`current_state`): each group continues its saved group's schedule."""
    out = dict(state)
    for key in _PER_GROUP:
        value = state.get(key)
        if isinstance(value, list):
            out[key] = [value[j] for j in group_map]
    if isinstance(state.get("_schedulers"), list):  # SequentialLR, ChainedScheduler
        out["_schedulers"] = [scheduler_state(s, group_map) for s in state["_schedulers"]]
    return out


def _members(optimizer: Any) -> list[Any]:
    """A ``ChainedOptimizer``'s members (megatron-FSDP's single optimizer is not chained)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _inner(member_state: Mapping[str, Any]) -> Any:
    """The torch-optimizer part of a member's state."""
    # bf16's `Float16OptimizerWithFloat16Params` nests it under "optimizer"
    return member_state.get("optimizer", member_state)


def _common_step(states: Sequence[Mapping[str, Any]]) -> Any:
    steps = [s["common_step"] for s in states if "common_step" in s]
    if any(not torch.equal(torch.as_tensor(s), torch.as_tensor(steps[0])) for s in steps):
        raise ValueError(
            f"The checkpoint's chained optimizers were saved at different steps ({steps}); "
            "they cannot be merged into one optimizer."
        )
    return steps[0] if steps else None


_IDENTITY = ("wd_mult", "lr_mult", "is_decoupled_lr")


def _saved_group(current: Mapping[str, Any], saved: Sequence[Mapping[str, Any]]) -> int:
    """Index of the saved group `current` continues (same identity; same `is_expert_parallel`
    preferred)."""
    # every saved group of that identity merges into it, so they must agree
    same = [j for j, g in enumerate(saved) if all(g[k] == current[k] for k in _IDENTITY)]
    if not same:
        raise ValueError(
            f"The checkpoint has no optimizer parameter group with "
            f"{ {k: current[k] for k in _IDENTITY} } (saved: "
            f"{[{k: g[k] for k in _IDENTITY} for g in saved]})."
        )
    j = next((j for j in same if saved[j]["is_expert_parallel"] == current["is_expert_parallel"]),
             same[0])  # fmt: skip
    for other in same:
        if not _same_hyperparameters(saved[j], saved[other]):
            raise ValueError(
                "The checkpoint's expert and dense optimizer parameter groups with "
                f"{ {k: current[k] for k in _IDENTITY} } have different hyper-parameters "
                f"({_differences(saved[j], saved[other])}); at this expert-parallel size they "
                "are one group. Resume with the saved `expert_model_parallel_size`."
            )
    return j


def _hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in ("params", "is_expert_parallel")}


def _same_hyperparameters(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return not _differences(a, b)


def _differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    ha, hb = _hyperparameters(a), _hyperparameters(b)
    keys = sorted(k for k in ha.keys() | hb.keys() if not _equal(ha.get(k), hb.get(k)))
    return ", ".join(f"{k}: {ha.get(k)!r} vs {hb.get(k)!r}" for k in keys)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return bool(a == b)
