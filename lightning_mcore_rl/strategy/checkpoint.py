"""Trainer-free megatron `dist_checkpointing` of a whole Lightning checkpoint dict: the model and
optimizer entries as sharded state dicts, everything else in `common.pt` (rank 0);
`StrategyCheckpoints` is what the strategy's checkpoint hooks delegate to."""

# ShardedTensors carry global offsets, so a checkpoint saved under one TP/PP layout loads under
# another; `check_layout` says which layout changes the saved optimizer state can follow.

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

from lightning_mcore_rl.parallel import unwrap_model
from lightning_mcore_rl.reliability import checksums as sums
from lightning_mcore_rl.strategy import optimizer_regroup as regroup
from lightning_mcore_rl.strategy.config import CheckpointConfig

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule

CHUNK_PREFIX = "chunks"


def sharded_model_state_dict(chunks: Sequence[torch.nn.Module]) -> dict[str, Any]:
    """Flat sharded state dict of all (unwrapped) model chunks, keyed `chunks.{i}.<name>`."""
    # the ShardedTensor keys themselves carry no chunk index: they match across VPP/PP layouts
    state: dict[str, Any] = {}
    for i, chunk in enumerate(chunks):
        for key, value in cast("MegatronModule", chunk).sharded_state_dict().items():
            state[f"{CHUNK_PREFIX}.{i}.{key}"] = value
    return state


def split_chunk_state_dict(state_dict: Mapping[str, Any], num_chunks: int) -> list[dict[str, Any]]:
    """Inverse of `sharded_model_state_dict`'s keying: one plain dict per chunk."""
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
    """A finished `dist_checkpointing` directory."""
    # megatron writes `metadata.json` last, after every rank's shards
    return path.is_dir() and (path / "metadata.json").is_file()


def save(checkpoint: dict[str, Any], path: Path, *, atomic: bool) -> None:
    """Collective: write `checkpoint` into directory `path` with `dist_checkpointing`, then its
    checksums (`reliability.checksums.write_manifest`); with `atomic`, written aside and swapped
    into place.

    Raises:
        OSError: `errno.ENOSPC` (disk full; also from inside megatron's shard writer, on rank
            0) with the file system's free space; the partial temporary directory is removed."""
    # `dist_checkpointing` needs an existing empty directory. With `atomic` every rank writes into
    # `.<name>.tmp`; after a barrier rank 0 swaps it in with ONE `renameat2(RENAME_EXCHANGE)`
    # (Linux) and deletes the previous checkpoint, so `path` always exists once written. Without
    # the exchange: two renames (old to `.<name>.old`, new into place); a kill between them leaves
    # two complete directories that `recover_interrupted` resolves. A crash during the write
    # leaves the previous checkpoint untouched. Torch's `CheckpointException` carries the failure
    # details only on the coordinating rank 0; the other ranks re-raise theirs as it is.
    from megatron.core import dist_checkpointing

    target = temporary_path(path) if atomic else path
    try:
        if _is_rank_zero():
            _remove(target)
            target.mkdir(parents=True)
        _barrier()
        dist_checkpointing.save(checkpoint, str(target))
        sums.write_manifest(target)
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
    """Move the complete directory `target` to `path`, replacing any old one."""
    # a kill at any instant leaves a complete `path`, or two complete directories that
    # `recover_interrupted` resolves
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
    """Undo saves in `directory` interrupted between the fallback's two renames: a missing
    `<name>.ckpt` gets the newest complete `.<name>.ckpt.tmp`/`.old` back (returned)."""
    # safe on every rank at once: each rename is atomic, losing a race is fine
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
    """The complete `*.ckpt` directories in `directory`, oldest first (`metadata.json` mtime)."""
    if not directory.is_dir():
        return []
    found = [p for p in directory.glob("*.ckpt") if is_complete(p)]
    return sorted(found, key=lambda p: (p / "metadata.json").stat().st_mtime)


def check_last(directory: Path, last_name: str = "last") -> None:
    """Before `ckpt_path="last"` is resolved in `directory` (any rank, no collective).

    Raises:
        FileNotFoundError: ``<last_name>*.ckpt`` entries exist but none is a complete checkpoint
            (each named with what it is instead)."""
    # Lightning skips a `<last_name>*.ckpt` entry that does not exist (a link to a removed
    # checkpoint) and starts from step 0 when none is left
    if not directory.is_dir():
        return
    entries = sorted(
        p for p in directory.iterdir() if p.suffix == ".ckpt" and p.name.startswith(last_name)
    )
    if not entries or any(is_complete(p) for p in entries):
        return
    complete = complete_checkpoints(directory)
    remedy = (
        f'resume from another checkpoint, e.g. `ckpt_path="{complete[-1]}"`'
        if complete
        else "restore it, or remove it to start from step 0"
    )
    raise FileNotFoundError(
        f'`ckpt_path="last"` found no loadable last checkpoint in {directory}: '
        f"{'; '.join(_describe_entry(p) for p in entries)}. Resuming from none would silently "
        f"start over: {remedy}."
    )


def _describe_entry(path: Path) -> str:
    """What an incomplete checkpoint entry is, for `check_last`'s message."""
    if path.is_symlink():
        target = os.readlink(path)
        state = "does not exist" if not path.exists() else "is not a complete checkpoint"
        return f"{path.name} is a symlink to {target}, which {state}"
    if path.is_dir():
        return f"{path.name} has no metadata.json (an unfinished save)"
    return f"{path.name} is a file, not a dist_checkpointing directory"


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _disk_full_cause(err: BaseException) -> BaseException | None:
    """The disk-full error behind `err` (`ENOSPC`/`EDQUOT` in its cause/context chain or in the
    failures of torch's `CheckpointException`), or None."""
    # megatron's shard writer reports a worker's `OSError` as `RuntimeError("Worker failure:
    # [Errno 28] ...")` whose cause is lost on the way (pickled through the workers' queue and
    # `gather_object`): only the `[Errno N]` text is left
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
    template: dict[str, Any], path: Path, safe_types: Sequence[type] = (), *, verify: bool = True
) -> dict[str, Any]:
    """Collective: load a checkpoint into the sharded `template`; returns the whole Lightning
    dict with plain tensors (`safe_types`: allowed when `common.pt` is read with
    `weights_only=True`; `verify`: check the checksums first).

    Raises:
        CorruptCheckpointError: on every rank, naming the damaged file."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException

    _check_is_checkpoint(path)
    if verify:
        sums.verify(path)
    with torch.serialization.safe_globals(list(safe_types)):
        try:
            return dist_checkpointing.load(template, str(path))
        except (Exception, CheckpointException) as err:  # torch's reader: CheckpointException
            if damaged := sums.damaged_files(path):  # torch's own text advises weights_only=False
                raise sums.corrupt_error(path, damaged) from None
            if "optimizer_states" in template and _looks_like_layout_mismatch(err):
                raise RuntimeError(
                    f"Loading the optimizer state of {path} failed ({type(err).__name__}: "
                    f"{err}). A distributed-optimizer checkpoint in the default "
                    "'dp_reshardable' format loads only under the TP/PP layout it was saved "
                    "with; to resume under another layout, save with "
                    '`MCoreRLStrategy(checkpoint=CheckpointConfig(optimizer_sharding="fully_'
                    'reshardable"))`, or resume under the saved layout.'
                ) from err
            raise


def _check_is_checkpoint(path: Path) -> None:
    if not (path / "metadata.json").exists():
        raise FileNotFoundError(
            f"{path} is not a megatron dist_checkpointing checkpoint directory (no metadata.json)."
        )


LAYOUT_KEY = "mcore_rl_layout"
"""Key of the saved layout (:data:`LAYOUT_FIELDS` and ``optimizer_sharding``) in the Lightning
checkpoint dict (rank 0's ``common.pt``)."""

LAYOUT_FIELDS = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "context_parallel_size", "data_parallel_size",
    "use_distributed_optimizer", "precision", "expert_model_parallel_size",
)  # fmt: skip
_MODEL_PARALLEL = LAYOUT_FIELDS[:4]


def check_layout(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> None:
    """Before the optimizer state is loaded (fitting): refuse the layout changes its saved format
    cannot follow.

    Raises:
        ValueError: `use_distributed_optimizer` or `precision` changed; EP changed with the
            distributed optimizer; a `dp_reshardable` checkpoint resumed under another
            TP/PP/VPP/CP size."""
    # Model weights follow any change, and megatron's regular optimizer state is keyed like them;
    # a changed EP regroups it between the chained dense and expert optimizers
    # (optimizer_regroup.py). The distributed optimizer's state is sharded by its own gradient
    # buffers (the expert ones over the expert-DP group whose size EP sets; per TP/PP rank for
    # `dp_reshardable`): not regrouped. Precision changes the format (bf16's fp32 main params).
    # Fields missing on either side (older checkpoints) are not compared.
    if not saved:
        return

    def changes(keys: Sequence[str]) -> str:
        return ", ".join(
            f"{key}: {saved[key]} -> {current[key]}"
            for key in keys
            if key in saved and key in current and saved[key] != current[key]
        )

    for key in ("use_distributed_optimizer", "precision"):
        if changed := changes([key]):
            raise ValueError(
                f"The checkpoint's optimizer state was saved with another `{key}` ({changed}); "
                "its format does not load into this optimizer. Resume with the saved setting "
                "(the weights alone load under any TP/PP layout, e.g. `validate(ckpt_path=...)`)."
            )
    if not (saved.get("use_distributed_optimizer") and current.get("use_distributed_optimizer")):
        return
    if changed := changes(["expert_model_parallel_size"]):
        raise ValueError(
            f"The checkpoint's distributed-optimizer state was saved under another "
            f"`expert_model_parallel_size` ({changed}); the distributed optimizer shards its "
            "state by its gradient buffers (the experts' over the expert data-parallel group, "
            "whose size EP sets), which are not regrouped. Resume with the saved "
            "`expert_model_parallel_size`, or train with `use_distributed_optimizer=False` "
            "(its state follows an EP change)."
        )
    changed = changes(_MODEL_PARALLEL)
    if saved.get("optimizer_sharding") == "dp_reshardable" and changed:
        raise ValueError(
            f"The checkpoint's distributed-optimizer state was saved in the 'dp_reshardable' "
            f"format under another layout ({changed}; saved {_sizes(saved)}, now "
            f"{_sizes(current)}); it loads only under the saved TP/PP/VPP/CP sizes (DP may "
            "change). Resume under the saved sizes, or save with "
            '`MCoreRLStrategy(checkpoint=CheckpointConfig(optimizer_sharding="fully_reshardable"))` '
            "to change the layout on resume."
        )


def expert_layout_changed(saved: Mapping[str, Any] | None, current: Mapping[str, Any]) -> bool:
    """Whether the checkpoint was saved under another `expert_model_parallel_size`."""
    key = "expert_model_parallel_size"
    if not saved or key not in saved:
        return False
    return bool(saved[key] != current[key])


def _sizes(layout: Mapping[str, Any]) -> str:
    names = ("TP", "PP", "VPP", "CP", "DP")
    return " ".join(f"{n}={layout.get(k)}" for n, k in zip(names, LAYOUT_FIELDS, strict=False))


def saved_layout(path: Path, safe_types: Sequence[type] = ()) -> dict[str, Any] | None:
    """The layout `LAYOUT_KEY` stored in the checkpoint's `common.pt` (None if absent); read on
    the calling rank, no collective."""
    from megatron.core import dist_checkpointing

    try:
        with torch.serialization.safe_globals(list(safe_types)):
            common = dist_checkpointing.load_common_state_dict(str(path))
    except Exception:  # noqa: BLE001 - an unreadable common.pt is reported by the load itself
        return None
    value = common.get(LAYOUT_KEY) if isinstance(common, Mapping) else None
    return dict(value) if isinstance(value, Mapping) else None


@dataclasses.dataclass(frozen=True)
class StrategyCheckpoints:
    """The strategy's checkpoint hooks, Trainer-free: sharded state dicts of its chunks and
    megatron optimizer, the layout saved beside them and the checks on resume."""

    chunks: Sequence[torch.nn.Module]  # wrapped (DDP / `Float16Module` around megatron models)
    optimizer: Any | None  # the megatron optimizer (fitting), or None (weights only)
    config: CheckpointConfig
    run_config: Mapping[str, Any]  # the strategy's `run_config()` (holds the `LAYOUT_FIELDS`)

    @property
    def layout(self) -> dict[str, Any]:
        """What `LAYOUT_KEY` holds for this run."""
        return {**{key: self.run_config[key] for key in LAYOUT_FIELDS},
                "optimizer_sharding": self.config.optimizer_sharding}  # fmt: skip

    def model_state(self) -> dict[str, Any]:
        """The chunks' sharded state dict (`sharded_model_state_dict`)."""
        return sharded_model_state_dict([unwrap_model(c) for c in self.chunks])

    def optimizer_state(self, *, is_loading: bool = False, sharding: str | None = None) -> dict:
        """The megatron optimizer's sharded state dict; `sharding`: the distributed optimizer's
        format (default `config.optimizer_sharding`)."""
        # a fresh distributed optimizer loading gets dummy state first: megatron asserts it exists
        optimizer = self.optimizer
        if optimizer is None:
            raise RuntimeError("The megatron optimizer exists only while fitting, after `setup`.")
        if is_loading and is_distributed_optimizer(optimizer):
            for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
                inner._init_optimizer_states_with_dummy_values()
        metadata = {"distrib_optim_sharding_type": sharding or self.config.optimizer_sharding}
        return optimizer.sharded_state_dict(
            self.model_state(), is_loading=is_loading, metadata=metadata
        )

    def save(
        self, checkpoint: dict[str, Any], path: Path, storage_options: Any | None = None
    ) -> None:
        """Collective: `save` with the layout added under `LAYOUT_KEY`.

        Raises:
            TypeError: ``storage_options`` given (Lightning's ``CheckpointIO`` argument)."""
        if storage_options is not None:
            raise TypeError(
                "MCoreRLStrategy.save_checkpoint does not take `storage_options`; "
                "configure checkpoints with `MCoreRLStrategy(checkpoint=CheckpointConfig(...))`."
            )
        save({**checkpoint, LAYOUT_KEY: self.layout}, path, atomic=self.config.atomic)

    def load(
        self, path: Path, model_state: dict[str, Any], hparams: Mapping[str, Any]
    ) -> dict[str, Any]:
        """Collective: the checkpoint at `path` loaded into `model_state` (this run's sharded
        model state, from any saved layout) and, when fitting, the optimizer's state."""
        # every rank reads the saved layout and runs `check_layout` before any collective; the
        # dataclass/enum types in the module's `hparams` may be unpickled (`user_types`)
        _check_is_checkpoint(path)
        sums.verify(path)  # before saved_layout reads common.pt
        safe_types = user_types(dict(hparams))
        saved = saved_layout(path, safe_types)
        template: dict[str, Any] = {"state_dict": model_state}
        if self.optimizer is not None:
            check_layout(saved, self.layout)
            if expert_layout_changed(saved, self.layout):
                return self._load_regrouped(path, template, safe_types)
            sharding = (saved or {}).get("optimizer_sharding")  # the format it was saved in
            state = self.optimizer_state(is_loading=True, sharding=sharding)
            template["optimizer_states"] = [state]
        return load(template, path, safe_types, verify=False)

    def _load_regrouped(
        self, path: Path, template: dict[str, Any], safe_types: Sequence[type]
    ) -> dict[str, Any]:
        """`load` of a checkpoint saved under another EP size: the optimizer state and the LR
        schedulers' per-group state regrouped (`optimizer_regroup`)."""
        from megatron.core import dist_checkpointing

        saved_keys = dist_checkpointing.load_tensors_metadata(str(path)).keys()
        optimizer_template = regroup.load_template(self.optimizer, self.model_state(), saved_keys)
        loaded = load({**template, "optimizer_states": [optimizer_template]}, path, safe_types,
                      verify=False)  # fmt: skip
        state, group_map = regroup.current_state(loaded["optimizer_states"][0], self.optimizer)
        loaded["optimizer_states"] = [state]
        schedulers = loaded.get("lr_schedulers", [])
        loaded["lr_schedulers"] = [regroup.scheduler_state(s, group_map) for s in schedulers]
        return loaded

    def load_model(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Load a loaded checkpoint's ``state_dict`` (plain tensors) into the chunks."""
        parts = split_chunk_state_dict(state_dict, len(self.chunks))
        for chunk, part in zip(self.chunks, parts, strict=True):
            unwrap_model(chunk).load_state_dict(part, strict=strict)


def _looks_like_layout_mismatch(err: BaseException) -> bool:
    if not isinstance(err, Exception):  # a CheckpointException's text holds whole tracebacks
        return False
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
