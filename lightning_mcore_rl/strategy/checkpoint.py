"""Trainer-free megatron ``dist_checkpointing`` of a whole Lightning checkpoint dict.

The model and optimizer entries are sharded state dicts (ShardedTensors with global offsets, so a
checkpoint saved under one TP/PP layout loads under another); everything else Lightning puts in
the dict (loops, callbacks, LR schedulers, hyper-parameters) is saved by rank 0 in ``common.pt``.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule

CHUNK_PREFIX = "chunks"


def sharded_model_state_dict(chunks: Sequence[torch.nn.Module]) -> dict[str, Any]:
    """Flat sharded state dict of all model chunks (unwrapped megatron models), keyed like the
    module's own ``state_dict`` (``chunks.{i}.<name>``). The ShardedTensor keys themselves carry no
    chunk index, so they match across VPP/PP layouts."""
    state: dict[str, Any] = {}
    for i, chunk in enumerate(chunks):
        for key, value in cast("MegatronModule", chunk).sharded_state_dict().items():
            state[f"{CHUNK_PREFIX}.{i}.{key}"] = value
    return state


def split_chunk_state_dict(state_dict: Mapping[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """Inverse of :func:`sharded_model_state_dict`'s keying: one plain dict per chunk."""
    parts: list[dict[str, Any]] = [{} for _ in range(num_chunks)]
    for key, value in state_dict.items():
        head, index, name = key.split(".", 2)
        if head != CHUNK_PREFIX or not index.isdigit() or int(index) >= num_chunks:
            raise KeyError(f"Unexpected model key {key!r} for {num_chunks} model chunk(s).")
        parts[int(index)][name] = value
    return parts


def is_distributed_optimizer(optimizer: Any) -> bool:
    """Whether a megatron optimizer (or any member of a chain) is a ``DistributedOptimizer``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(isinstance(o, DistributedOptimizer) for o in inner)


def load_template(
    model_state: dict[str, Any], optimizer: Any | None, sharding: str
) -> dict[str, Any]:
    """What :func:`load` fills: the live model's sharded state dict (any TP/PP layout the
    weights were saved under maps onto it) and, when fitting, the optimizer's."""
    template: dict[str, Any] = {"state_dict": model_state}
    if optimizer is not None:
        template["optimizer_states"] = [
            sharded_optimizer_state_dict(optimizer, model_state, sharding=sharding, is_loading=True)
        ]
    return template


def sharded_optimizer_state_dict(
    optimizer: Any, model_state: dict[str, Any], *, sharding: str, is_loading: bool
) -> dict[str, Any]:
    """The megatron optimizer's sharded state dict (distributed optimizer in ``sharding``
    format). A fresh distributed optimizer gets dummy state first: megatron asserts it exists."""
    if is_loading and is_distributed_optimizer(optimizer):
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            inner._init_optimizer_states_with_dummy_values()
    return optimizer.sharded_state_dict(
        model_state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": sharding}
    )


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_rank_zero() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def save(checkpoint: dict[str, Any], path: Path, *, atomic: bool) -> None:
    """Collective: write ``checkpoint`` into directory ``path`` with ``dist_checkpointing``.

    ``dist_checkpointing`` needs an existing empty directory. With ``atomic``, every rank writes
    into ``.<name>.tmp`` beside ``path``; after a barrier rank 0 moves any old ``path`` aside,
    renames the temporary directory into place and deletes the old one. A crash during the write
    therefore leaves the previous checkpoint untouched.
    """
    from megatron.core import dist_checkpointing

    target = path.with_name(f".{path.name}.tmp") if atomic else path
    if _is_rank_zero():
        _remove(target)
        target.mkdir(parents=True)
    _barrier()
    dist_checkpointing.save(checkpoint, str(target))
    _barrier()
    if atomic and _is_rank_zero():
        old = path.with_name(f".{path.name}.old")
        _remove(old)
        if path.is_symlink():
            path.unlink()
        elif path.exists():
            os.replace(path, old)
        os.replace(target, path)
        _remove(old)
    _barrier()


def remove(path: Path) -> None:
    """Delete a checkpoint directory (or a ``save_last="link"`` symlink) on rank 0."""
    if _is_rank_zero():
        _remove(path)


def load(template: dict[str, Any], path: Path, safe_types: Sequence[type] = ()) -> dict[str, Any]:
    """Collective: load a checkpoint into the sharded ``template``; returns the whole Lightning
    dict with plain tensors. ``safe_types`` are allowed when ``torch.load`` reads ``common.pt``
    with ``weights_only=True`` (e.g. the dataclasses in ``save_hyperparameters()``)."""
    from megatron.core import dist_checkpointing

    if not (path / "metadata.json").exists():
        raise FileNotFoundError(
            f"{path} is not a megatron dist_checkpointing checkpoint directory (no metadata.json)."
        )
    with torch.serialization.safe_globals(list(safe_types)):
        return dist_checkpointing.load(template, str(path))


def user_types(obj: Any) -> list[type]:
    """Dataclass and enum types reachable from ``obj`` (mappings, sequences, dataclass fields)."""
    found: dict[type, None] = {}
    for value in _walk(obj, depth=0):
        is_instance = dataclasses.is_dataclass(value) and not isinstance(value, type)
        if is_instance or isinstance(value, enum.Enum):
            found[type(value)] = None
    return list(found)


def _walk(obj: Any, depth: int) -> Iterator[Any]:
    if depth > 20:
        return
    yield obj
    if isinstance(obj, Mapping):
        for value in obj.values():
            yield from _walk(value, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            yield from _walk(value, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _walk(getattr(obj, f.name), depth + 1)
