"""A frozen teacher hosted next to the policy (`HostedTeacher`, owned by the strategy): built,
checked, wrapped without DDP and checkpointed under its own keys."""

# The module builds the raw chunks (`MCoreRLModule.build_teacher_chunk`, one per VPP stage, the
# policy's layout); they are never given to the optimizer and enter the checkpoint only when the
# module asks (`save_teacher_in_checkpoint`), under `TEACHER_PREFIX`, so a student checkpoint's
# keys never collide with them.

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from lightning_mcore_rl.strategy.model import WrappedChunks, build_stage_chunks, check_chunk_layout

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule

TEACHER_PREFIX = "teacher_chunks"
"""Head of the teacher's entries in the model state dict (``teacher_chunks.{i}.<name>``)."""

TEACHER_CHECKPOINT_PREFIX = "teacher."
"""Prefix of the teacher's ShardedTensor keys in a checkpoint (``teacher.decoder...``)."""


def build_teacher_chunks(
    build: Callable[[int | None], torch.nn.Module | None], vp_stages: Sequence[int | None]
) -> list[torch.nn.Module] | None:
    """The teacher's raw chunks `build(vp_stage)` per stage, frozen and in eval mode; `None`
    when every call returns `None`.

    Raises:
        ValueError: some stages return a chunk and others ``None``."""
    built = build_stage_chunks(build, vp_stages, "build_teacher_chunk")
    if all(chunk is None for chunk in built):
        return None
    missing = [stage for stage, chunk in zip(vp_stages, built, strict=True) if chunk is None]
    if missing:
        raise ValueError(
            f"`build_teacher_chunk(vp_stage)` returned None for vp_stage(s) {missing} but a "
            "chunk for the others; return a teacher chunk for every stage, or None for all "
            "(no teacher)."
        )
    chunks = cast("list[torch.nn.Module]", built)
    for chunk in chunks:
        chunk.requires_grad_(False)
        chunk.eval()
    return chunks


def _agree_on_presence(present: bool, device: torch.device | str) -> None:
    """Raise on every rank unless all ranks host a teacher or none does (one all-reduce)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    flags = torch.tensor([float(present), -float(present)], device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    if flags[0] != -flags[1]:  # max(present) != min(present)
        raise ValueError(
            f"`build_teacher_chunk` returned a teacher on some ranks and None on others (this "
            f"rank: {'a teacher' if present else 'None'}); every rank (each TP/PP/DP position) "
            "must build its teacher chunks, or none."
        )


class HostedTeacher:
    """The strategy's wrapped teacher chunks (empty without a teacher)."""

    def __init__(self) -> None:
        self._wrapped = WrappedChunks()
        self.chunks: list[torch.nn.Module] = []

    def setup(
        self,
        module: Any,
        vp_stages: Sequence[int | None],
        expected: Mapping[str, Any],
        *,
        bf16: bool,
        device: torch.device | str = "cpu",
    ) -> None:
        """Check `module.teacher_chunks` (the policy's layout) and wrap them: `Float16Module`
        under bf16, no megatron DDP, eval mode, no gradients.

        Raises:
            TypeError, ValueError: as `model.check_chunk_layout`; a teacher parameter with
                `requires_grad=True`; a teacher on some ranks only (on every rank)."""
        # every rank hosts a teacher or none, agreed by ONE all-reduce: a rank without one would
        # leave the others waiting in a later `teacher=True` pass
        raw = getattr(module, "teacher_chunks", None)
        _agree_on_presence(bool(raw), device)
        if not raw:
            self.chunks = []
            return
        check_chunk_layout(
            raw, vp_stages, expected, what="teacher chunk", hook="build_teacher_chunk"
        )
        trainable = [n for chunk in raw for n, p in chunk.named_parameters() if p.requires_grad]
        if trainable:
            raise ValueError(
                f"The teacher is frozen, but {len(trainable)} of its parameters require grad "
                f"(first: {trainable[0]!r}); do not re-enable `requires_grad` on "
                "`module.teacher_chunks`."
            )
        self.chunks = self._wrapped.update(raw, bf16=bf16, ddp_config=None)
        for chunk in self.chunks:
            chunk.eval()

    def select(self, teacher: bool, policy: list[torch.nn.Module]) -> list[torch.nn.Module]:
        """The chunks a forward-only pass runs: the teacher's or `policy`.

        Raises:
            ValueError: ``teacher=True`` without a hosted teacher."""
        if not teacher:
            return policy
        if not self.chunks:
            raise ValueError(
                "`teacher=True` but the module hosts no teacher: override "
                "`MCoreRLModule.build_teacher_chunk(vp_stage)` to return the teacher's megatron "
                "chunk for each virtual pipeline stage."
            )
        return self.chunks

    def state_dict(self, module: Any) -> dict[str, Any]:
        """The teacher's sharded state dict (`teacher_chunks.{i}.<name>`, ShardedTensor keys
        prefixed `TEACHER_CHECKPOINT_PREFIX`); empty unless `save_teacher_in_checkpoint`."""
        if not (self.chunks and getattr(module, "save_teacher_in_checkpoint", False)):
            return {}
        state: dict[str, Any] = {}
        for i, chunk in enumerate(module.teacher_chunks):
            sharded = chunk.sharded_state_dict(prefix=TEACHER_CHECKPOINT_PREFIX)
            for key, value in sharded.items():
                state[f"{TEACHER_PREFIX}.{i}.{key[len(TEACHER_CHECKPOINT_PREFIX) :]}"] = value
        return state

    def load_state_dict(self, module: Any, state_dict: Mapping[str, Any]) -> dict[str, Any]:
        """Load the teacher's entries of `state` into `module.teacher_chunks`; returns the
        remaining (policy) entries."""
        head = f"{TEACHER_PREFIX}."
        policy = {k: v for k, v in state_dict.items() if not k.startswith(head)}
        if len(policy) == len(state_dict):
            return policy
        parts: list[dict[str, Any]] = [{} for _ in module.teacher_chunks]
        for key, value in state_dict.items():
            if key.startswith(head):
                index, name = key[len(head) :].split(".", 1)
                parts[int(index)][name] = value
        for chunk, part in zip(module.teacher_chunks, parts, strict=True):
            chunk.load_state_dict(part)
        return policy


def load_dist_checkpoint(chunk: torch.nn.Module, path: str | Path, *, prefix: str = "") -> None:
    """Load a megatron `dist_checkpointing` checkpoint's weights (not `common.pt`) into the
    unwrapped `chunk`, only its shards, from any saved TP/PP/VPP layout (collective; e.g. in
    `build_teacher_chunk`). `prefix`: `""` for a student checkpoint of this project, `"teacher."`
    for a teacher saved with `save_teacher_in_checkpoint`.

    Raises:
        FileNotFoundError: `path` is not a `dist_checkpointing` directory."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class _TensorsOnly(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir: str | Path) -> dict[str, Any]:
            return {}

    if not (Path(path) / "metadata.json").is_file():
        raise FileNotFoundError(
            f"`path={str(path)!r}` is not a megatron dist_checkpointing directory (no "
            "metadata.json)."
        )
    sharded = cast("MegatronModule", chunk).sharded_state_dict(prefix=prefix)
    loaded = dist_checkpointing.load(sharded, str(path), common_strategy=_TensorsOnly())
    chunk.load_state_dict({key[len(prefix) :]: value for key, value in loaded.items()})
