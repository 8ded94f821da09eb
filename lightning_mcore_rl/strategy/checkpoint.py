"""Trainer-free megatron ``dist_checkpointing`` of a whole Lightning checkpoint dict.

The model and optimizer entries are sharded state dicts (ShardedTensors with global offsets, so a
checkpoint saved under one TP/PP layout loads under another); everything else Lightning puts in
the dict (loops, callbacks, LR schedulers, hyper-parameters) is saved by rank 0 in ``common.pt``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import errno
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


def temporary_path(path: Path) -> Path:
    """Where an atomic save of ``path`` writes first (``.<name>.tmp``)."""
    return path.with_name(f".{path.name}.tmp")


def old_path(path: Path) -> Path:
    """Where the two-rename fallback moves the previous ``path`` (``.<name>.old``)."""
    return path.with_name(f".{path.name}.old")


def is_complete(path: Path) -> bool:
    """A finished ``dist_checkpointing`` directory: megatron writes ``metadata.json`` last,
    after every rank's shards."""
    return path.is_dir() and (path / "metadata.json").is_file()


def save(checkpoint: dict[str, Any], path: Path, *, atomic: bool) -> None:
    """Collective: write ``checkpoint`` into directory ``path`` with ``dist_checkpointing``.

    ``dist_checkpointing`` needs an existing empty directory. With ``atomic``, every rank writes
    into ``.<name>.tmp`` beside ``path``; after a barrier rank 0 swaps it into place with ONE
    atomic ``renameat2(RENAME_EXCHANGE)`` (Linux) and deletes the previous checkpoint, now at the
    temporary name, so ``path`` always exists once it has been written. Where the exchange is
    unavailable, two renames (old aside to ``.<name>.old``, new into place); a kill between them
    leaves both complete directories, and :func:`recover_interrupted` (run before
    ``ckpt_path="last"`` is resolved) renames the newest back. A crash during the write leaves
    the previous checkpoint untouched.

    Raises:
        OSError: ``errno.ENOSPC`` (the disk is full) with the free space of the checkpoint's
            file system in the message; the partial temporary directory is removed. Also when
            the full disk reaches it inside megatron's shard writer (torch's
            ``CheckpointException``, on the coordinating rank 0: the other ranks' exception
            carries no failure details and is re-raised as it is).
    """
    from megatron.core import dist_checkpointing

    target = temporary_path(path) if atomic else path
    try:
        if _is_rank_zero():
            _remove(target)
            target.mkdir(parents=True)
        _barrier()
        dist_checkpointing.save(checkpoint, str(target))
    except BaseException as err:  # megatron's shard writers fail with a CheckpointException
        cause = _disk_full_cause(err)
        if cause is None:
            raise
        if atomic:
            _remove_quietly(target)
        raise _disk_full_error(cause, path) from err
    _barrier()
    if atomic and _is_rank_zero():
        replace_directory(target, path)
    _barrier()


def replace_directory(target: Path, path: Path) -> None:
    """Move the complete directory ``target`` to ``path`` (replacing any old one) so that a kill
    at any instant leaves a complete ``path``, or two complete directories that
    :func:`recover_interrupted` resolves."""
    if path.is_symlink():  # a `save_last="link"` link: its target checkpoint stays
        path.unlink()
    if path.exists() and _exchange(target, path):
        _remove(target)  # the previous checkpoint, swapped to the temporary name
        return
    old = old_path(path)
    _remove(old)
    if path.exists():
        os.replace(path, old)
    os.replace(target, path)
    _remove(old)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux ``renameat2``); False where unsupported."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    rc = renameat2(
        _AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), ctypes.c_uint(_RENAME_EXCHANGE)
    )
    return rc == 0


def recover_interrupted(directory: Path) -> list[Path]:
    """Undo a save interrupted between the two renames of the fallback in ``directory``: for
    each ``<name>.ckpt`` that is missing while ``.<name>.ckpt.tmp`` (the new one) or
    ``.<name>.ckpt.old`` (the previous one) is complete, rename the newest complete one back.

    Safe to run on every rank at once (each rename is atomic; losing a race is fine).

    Returns:
        The checkpoints restored.
    """
    restored: list[Path] = []
    if not directory.is_dir():
        return restored
    for entry in sorted(directory.iterdir()):
        name = entry.name
        if not (name.startswith(".") and name.endswith((".ckpt.tmp", ".ckpt.old"))):
            continue
        path = directory / name[1:].rsplit(".", 1)[0]
        if path.exists():
            continue
        for candidate in (temporary_path(path), old_path(path)):  # newest first
            if not is_complete(candidate):
                continue
            with contextlib.suppress(OSError):  # another rank won the race: `path` exists now
                os.rename(candidate, path)
            if path.exists():
                restored.append(path)
                break
    return restored


def complete_checkpoints(directory: Path) -> list[Path]:
    """The complete ``*.ckpt`` directories in ``directory``, oldest first (by modification time
    of their ``metadata.json``)."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.glob("*.ckpt") if is_complete(p)]
    return sorted(found, key=lambda p: (p / "metadata.json").stat().st_mtime)


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _disk_full_cause(err: BaseException) -> BaseException | None:
    """The disk-full error behind ``err``, or None: an ``OSError`` with ``ENOSPC``/``EDQUOT`` in
    its cause/context chain, or in the failures of torch's ``CheckpointException`` (a
    ``BaseException``; rank -> (exception, traceback)), where megatron's shard writer reports a
    worker's ``OSError`` as ``RuntimeError("Worker failure: [Errno 28] ...")`` whose cause is
    lost on the way (pickled through the workers' queue and ``gather_object``): only the
    ``[Errno N]`` text is left."""
    pending: list[BaseException | None] = [err]
    seen: set[int] = set()
    while pending:
        item = pending.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, OSError) and item.errno in _DISK_FULL:
            return item
        if isinstance(item, RuntimeError) and any(f"[Errno {n}]" in str(item) for n in _DISK_FULL):
            return item
        failures = getattr(item, "failures", None)
        if isinstance(failures, Mapping):
            for value in failures.values():
                first = value[0] if isinstance(value, tuple) and value else value
                pending.append(first if isinstance(first, BaseException) else None)
        pending.extend((item.__cause__, item.__context__))
    return None


def _is_disk_full(err: BaseException) -> bool:
    return _disk_full_cause(err) is not None


def _disk_full_error(err: BaseException, path: Path) -> OSError:
    probe = path.parent if path.parent.exists() else Path(".")
    try:
        free = shutil.disk_usage(probe).free
        space = f"{free / 2**20:.1f} MiB free"
    except OSError:
        space = "free space unknown"
    return OSError(
        errno.ENOSPC,
        f"The disk is full: saving checkpoint {path} failed ({space} on the file system of "
        f"{probe}; {err}). Free space or point `ModelCheckpoint(dirpath=...)` elsewhere; the "
        "previous checkpoint is untouched.",
    )


def _remove_quietly(path: Path) -> None:
    try:
        if _is_rank_zero():
            _remove(path)
    except OSError:
        pass


def remove(path: Path) -> None:
    """Delete a checkpoint directory (or a ``save_last="link"`` symlink) on rank 0."""
    if _is_rank_zero():
        _remove(path)


def load(
    template: dict[str, Any],
    path: Path,
    safe_types: Sequence[type] = (),
    layout: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Collective: load a checkpoint into the sharded ``template``; returns the whole Lightning
    dict with plain tensors. ``safe_types`` are allowed when ``torch.load`` reads ``common.pt``
    with ``weights_only=True`` (e.g. the dataclasses in ``save_hyperparameters()``). With the
    current ``layout`` (:data:`LAYOUT_KEY`'s fields) a layout the saved optimizer format cannot
    follow raises first (:func:`check_layout`)."""
    from megatron.core import dist_checkpointing

    if not (path / "metadata.json").exists():
        raise FileNotFoundError(
            f"{path} is not a megatron dist_checkpointing checkpoint directory (no metadata.json)."
        )
    with torch.serialization.safe_globals(list(safe_types)):
        if layout is not None and "optimizer_states" in template:
            check_layout(saved_layout(path), layout)
        try:
            return dist_checkpointing.load(template, str(path))
        except Exception as err:
            if "optimizer_states" in template and _looks_like_layout_mismatch(err):
                raise RuntimeError(
                    f"Loading the optimizer state of {path} failed ({type(err).__name__}: "
                    f"{err}). A distributed-optimizer checkpoint in the default "
                    "'dp_reshardable' format loads only under the layout it was saved with; "
                    "to resume under another data-parallel (or TP/PP) size, save with "
                    '`MCoreRLStrategy(checkpoint=CheckpointConfig(optimizer_sharding="fully_'
                    'reshardable"))`, or resume under the saved layout.'
                ) from err
            raise


LAYOUT_KEY = "mcore_rl_layout"
"""Key of the saved layout (sizes and optimizer format) in the Lightning checkpoint dict."""


def check_layout(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> None:
    """Before loading: a ``dp_reshardable`` distributed-optimizer checkpoint resumed under
    another data-parallel size fails inside megatron with a shape error; say what to do.

    Raises:
        ValueError: the layouts differ where the saved optimizer format cannot follow.
    """
    if not saved or not current.get("use_distributed_optimizer"):
        return
    if not saved.get("use_distributed_optimizer"):
        return
    if saved.get("optimizer_sharding") != "dp_reshardable":
        return
    changed = [
        f"{key}: {saved.get(key)} -> {current.get(key)}"
        for key in ("data_parallel_size", "tensor_model_parallel_size",
                    "pipeline_model_parallel_size")
        if saved.get(key) != current.get(key)
    ]  # fmt: skip
    if changed:
        raise ValueError(
            f"The checkpoint's distributed-optimizer state was saved in the 'dp_reshardable' "
            f"format under another layout ({', '.join(changed)}); it loads only under the saved "
            "layout. Resume under the saved sizes, or save with "
            '`MCoreRLStrategy(checkpoint=CheckpointConfig(optimizer_sharding="fully_reshardable"))` '
            "to change the layout on resume."
        )


def saved_layout(path: Path) -> dict[str, Any] | None:
    """The layout :data:`LAYOUT_KEY` stored in the checkpoint's ``common.pt`` (None if absent)."""
    from megatron.core import dist_checkpointing

    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
    except Exception:  # noqa: BLE001 - an unreadable common.pt is reported by the load itself
        return None
    value = common.get(LAYOUT_KEY) if isinstance(common, Mapping) else None
    return dict(value) if isinstance(value, Mapping) else None


def _looks_like_layout_mismatch(err: BaseException) -> bool:
    text = f"{type(err).__name__} {err}".lower()
    return any(word in text for word in ("shape", "size mismatch", "global_shape", "dp_reshard"))


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
