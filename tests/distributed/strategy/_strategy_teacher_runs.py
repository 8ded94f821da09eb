"""Rank functions of ``test_strategy_teacher``: a frozen teacher hosted by the module
(``build_teacher_chunk``) under a Trainer, distilled into the tiny GPT with the top-k KL and the
full-vocabulary OPD loss ("logits" and "hidden_states" payloads).

Every fit trains on the fixed :func:`~_hook_runs.probe_batch` (each DP rank the same 4 rows, so
the global token mean is the mean over those rows). The first training step evaluates the three
losses forward-only on the teacher's outputs of that step (the teacher's top-k / payload computed
with ``teacher=True``), then trains on the OPD logits loss; the second step recomputes the
teacher's top-k (unchanged teacher, changed student).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from _hook_runs import BATCH, Reference, _Recorder, _trainer_options, probe_batch, reference_forward
from _strategy_rl_runs import RolloutRows
from _strategy_runs import VOCAB
from lightning.pytorch import Trainer
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_mcore_rl import MCoreRLModule, MCoreRLStrategy
from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import DistillationLossFn, OPDFullLossFn
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.strategy.teacher import load_dist_checkpoint
from lightning_mcore_rl.train import LossPostProcessor

K = 5
LOSSES = ("topk", "logits", "hidden_states")


@dataclass(frozen=True)
class TeacherFit:
    """One fit: the teacher's weight seed (0: the student's own initial weights) and layout."""

    teacher_seed: int
    sequence_parallel: bool = False
    bf16: bool = False
    checkpoints: bool = False  # save one checkpoint without and one with the teacher


@dataclass
class TeacherRun:
    """One rank's fit: the step-0 losses, what the teacher looked like during it, the
    plain-torch reference of the student and the teacher."""

    layout: tuple[int, int, int]  # (TP, PP, DP) of the fit
    ids: Tensor
    losses: dict[str, float]
    rows: list[dict[str, float]]
    teacher_topk: list[tuple[Tensor, Tensor]]
    teacher_logprobs: Tensor | None
    student_logprobs: list[Tensor]
    teacher_modes: list[bool]  # every teacher submodule's `training` flag, raw and wrapped
    teacher_requires_grad: list[bool]
    teacher_unchanged: bool
    student_changed: bool
    optimizer_overlap: int  # teacher parameters among the optimizer's
    optimizer_params: int
    teacher_in_parameters: bool  # teacher parameters in module.parameters()
    teacher_wrappers: list[str]  # type of each wrapped teacher chunk
    checkpoint_keys: dict[str, list[str]] = field(default_factory=dict)
    student: Reference | None = None
    teacher: Reference | None = None


class TeacherModule(MCoreRLModule):
    """The tiny GPT student (seed 0) with a tiny GPT teacher of ``teacher_seed``."""

    def __init__(self, teacher_seed: int, lr: float = 1e-2) -> None:
        super().__init__(loss_fn=OPDFullLossFn())
        self.teacher_seed = teacher_seed
        self.lr = lr
        self.batch = probe_batch()
        self.hidden_payload = False
        self.losses: dict[str, float] = {}
        self.teacher_topk: list[tuple[Tensor, Tensor]] = []
        self.teacher_logprobs: Tensor | None = None
        self.student_logprobs: list[Tensor] = []
        self.teacher_modes: list[bool] = []
        self.teacher_requires_grad: list[bool] = []
        self.initial: dict[str, list[Tensor]] = {}

    def _config(self) -> Any:
        strategy = self.mcore_strategy
        sp, bf16 = strategy.parallel.sequence_parallel, strategy.precision_plugin.bf16
        return tiny_gpt_config(
            self.parallel_groups, calculate_per_token_loss=True, sequence_parallel=sp, bf16=bf16
        )

    def _chunk(self, seed: int, vp_stage: int | None) -> torch.nn.Module:
        return tiny_gpt(self._config(), groups=self.parallel_groups, vocab_size=VOCAB, seed=seed,
                        vp_stage=vp_stage)  # fmt: skip

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        return self._chunk(0, vp_stage)

    def build_teacher_chunk(self, vp_stage: int | None) -> torch.nn.Module | None:
        return self._chunk(self.teacher_seed, vp_stage)

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=self.lr, adam_eps=1e-4, weight_decay=0.0)

    def loss_post_processor(self, num_microbatches: int | None = None) -> LossPostProcessor:
        """The default one, plus the teacher's LM-head shard for hidden-state payloads."""
        assert self.loss_fn is not None
        weight = self.teacher_output_weight() if self.hidden_payload else None
        return LossPostProcessor(
            self.loss_fn,
            self.mcore_strategy.policy_config(),
            num_microbatches,
            sampling_params=self.sampling_params(),
            teacher_output_layer_weight_by_index=None if weight is None else {0: weight},
        )

    @contextlib.contextmanager
    def _loss(self, name: str) -> Iterator[None]:
        """The block's loss: top-k KL or OPD full (logits / hidden-state payload)."""
        loss_fn, self.loss_fn = (
            self.loss_fn,
            DistillationLossFn() if name == "topk" else OPDFullLossFn(),
        )
        self.hidden_payload = name == "hidden_states"
        try:
            yield
        finally:
            self.loss_fn, self.hidden_payload = loss_fn, False

    def distillation_batch(self) -> dict[str, BatchedDataDict]:
        """The probe batch with each loss's teacher fields (computed on the teacher)."""
        b = self.batch
        values, indices = self.compute_topk_logits(b, K, teacher=True)
        self.teacher_topk.append((values, indices))
        _, logits = self.compute_teacher_payload(b, "logits", torch.float32, teacher=True)
        _, hidden = self.compute_teacher_payload(b, "hidden_states", torch.float32, teacher=True)
        index = torch.zeros(BATCH, dtype=torch.long)
        return {
            "topk": BatchedDataDict(
                {**b, "teacher_topk_logits": values, "teacher_topk_indices": indices}
            ),
            "logits": BatchedDataDict({**b, "teacher_full_payload": logits}),
            "hidden_states": BatchedDataDict(
                {**b, "teacher_full_payload": hidden, "teacher_index": index}
            ),
        }

    def training_step(self, batch: Any, batch_idx: int = 0) -> dict[str, Any]:
        self.student_logprobs.append(self.compute_logprobs(self.batch))
        batches = self.distillation_batch()
        if batch_idx == 0 and not self.losses:
            wrapped = self.mcore_strategy.teacher.chunks
            raw = self.teacher_chunks or []
            self.teacher_modes = [m.training for c in [*raw, *wrapped] for m in c.modules()]
            self.teacher_requires_grad = [p.requires_grad for c in raw for p in c.parameters()]
            self.initial = {"teacher": _values(raw), "student": _values(self.chunks or [])}
            self.teacher_logprobs = self.compute_logprobs(self.batch, teacher=True)
            for name in LOSSES:
                with self._loss(name):
                    self.losses[name] = float(self.forward_backward(batches[name], True).loss)
        return self.forward_backward(batches["logits"]).as_step_result()


def _values(chunks: Any) -> list[Tensor]:
    return [p.detach().clone() for c in chunks for p in c.parameters()]


def _checkpoint_keys(path: Path) -> list[str]:
    from megatron.core.dist_checkpointing import load_tensors_metadata

    return sorted(load_tensors_metadata(str(path)))


def _strategy(sizes: tuple[int, int], sequence_parallel: bool = False) -> MCoreRLStrategy:
    tp, pp = sizes
    return MCoreRLStrategy(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=sequence_parallel,
        microbatching=MicrobatchConfig(micro_batch_size=2),
    )


def _fit(
    sizes: tuple[int, int], spec: TeacherFit, directory: Path
) -> tuple[TeacherModule, Trainer, TeacherRun]:
    recorder = _Recorder()
    strategy = _strategy(sizes, spec.sequence_parallel)
    precision = "bf16-mixed" if spec.bf16 else "32-true"
    trainer = Trainer(**_trainer_options(int(os.environ["WORLD_SIZE"]), strategy=strategy,
                                         max_steps=2, callbacks=[recorder],
                                         precision=precision))  # fmt: skip
    module = TeacherModule(spec.teacher_seed)
    trainer.fit(module, DataLoader(RolloutRows(2 * BATCH), batch_size=BATCH))
    raw = module.teacher_chunks or []
    teacher_ids = {id(p) for c in raw for p in c.parameters()}
    optimizer_ids = {
        id(p) for group in trainer.strategy.optimizers[0].param_groups for p in group["params"]
    }
    final = {"teacher": _values(raw), "student": _values(module.chunks or [])}
    pairs = {k: list(zip(module.initial[k], final[k], strict=True)) for k in final}
    groups = trainer.strategy.groups
    run = TeacherRun(
        layout=(groups.tp_size, groups.pp_size, groups.dp_size),
        ids=cast(Tensor, module.batch["input_ids"]),
        losses=module.losses,
        rows=recorder.rows,
        teacher_topk=module.teacher_topk,
        teacher_logprobs=module.teacher_logprobs,
        student_logprobs=module.student_logprobs,
        teacher_modes=module.teacher_modes,
        teacher_requires_grad=module.teacher_requires_grad,
        teacher_unchanged=all(torch.equal(a, b) for a, b in pairs["teacher"]),
        student_changed=any(not torch.equal(a, b) for a, b in pairs["student"]),
        optimizer_overlap=len(teacher_ids & optimizer_ids),
        optimizer_params=len(optimizer_ids),
        teacher_in_parameters=any(id(p) in teacher_ids for p in module.parameters()),
        teacher_wrappers=[type(c).__name__ for c in trainer.strategy.teacher.chunks],
    )
    if spec.checkpoints:
        for name, switch in (("student_only", False), ("with_teacher", True)):
            module.save_teacher_in_checkpoint = switch
            path = directory / f"{name}.ckpt"
            trainer.save_checkpoint(path)
            run.checkpoint_keys[name] = _checkpoint_keys(path)
        module.save_teacher_in_checkpoint = False
    return module, trainer, run


def teacher_rank(
    rank: int, sizes: tuple[int, int], fits: dict[str, TeacherFit], directory: str
) -> dict[str, Any]:
    """Every fit of ``fits`` under ``sizes = (TP, PP)`` (DP = world / TP / PP), then the TP=1
    references."""
    runs: dict[str, Any] = {}
    for name, spec in fits.items():
        module, _, run = _fit(sizes, spec, Path(directory) / name)
        runs[name] = run
        if spec.checkpoints:
            runs["loaded"] = _load_rank(sizes, Path(directory) / name, module)
    for name, spec in fits.items():  # re-initialises megatron at TP=1: after every fit
        run = runs[name]
        run.student = reference_forward(run.ids)
        run.teacher = reference_forward(run.ids, seed=spec.teacher_seed)
    return runs


# ---------------------------------------------------------------- loading teacher weights


class LoadedTeacher(MCoreRLModule):
    """A teacher of seed 2 overwritten by ``load_dist_checkpoint`` from ``path`` (``prefix``)."""

    def __init__(self, path: Path, prefix: str) -> None:
        super().__init__()
        self.path = path
        self.prefix = prefix
        self.loaded: list[Tensor] = []

    def _chunk(self, seed: int, vp_stage: int | None) -> torch.nn.Module:
        groups = self.parallel_groups
        return tiny_gpt(tiny_gpt_config(groups), groups=groups, vocab_size=VOCAB, seed=seed,
                        vp_stage=vp_stage)  # fmt: skip

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        return self._chunk(3, vp_stage)

    def build_teacher_chunk(self, vp_stage: int | None) -> torch.nn.Module | None:
        chunk = self._chunk(2, vp_stage)
        load_dist_checkpoint(chunk, self.path, prefix=self.prefix)
        return chunk

    def validation_step(self, batch: Any, batch_idx: int = 0) -> None:
        self.loaded = _values(self.teacher_chunks)


def _load_rank(sizes: tuple[int, int], directory: Path, trained: TeacherModule) -> dict[str, bool]:
    """``load_dist_checkpoint`` into a seed-2 teacher: from the student-only checkpoint
    (``prefix=""``: the trained student's weights) and from the teacher saved in the other one
    (``prefix="teacher."``: the trained run's teacher); then a resume restoring the teacher."""
    expected = {
        "student_only": (_values(trained.chunks), ""),
        "with_teacher": (_values(trained.teacher_chunks), "teacher."),
    }
    equal = {}
    for name, (values, prefix) in expected.items():
        strategy = _strategy(sizes)
        trainer = Trainer(**_trainer_options(int(os.environ["WORLD_SIZE"]), strategy=strategy,
                                             limit_val_batches=1))  # fmt: skip
        module = LoadedTeacher(directory / f"{name}.ckpt", prefix)
        trainer.validate(module, DataLoader(RolloutRows(2 * BATCH), batch_size=BATCH))
        pairs = zip(module.loaded, values, strict=True)
        equal[name] = all(torch.equal(a, b) for a, b in pairs)
    equal["resumed"] = _resume_rank(sizes, directory / "with_teacher.ckpt", trained)
    return equal


def _resume_rank(sizes: tuple[int, int], path: Path, trained: TeacherModule) -> bool:
    """Resume one more step from the checkpoint holding the teacher, with a seed-2 teacher and
    ``save_teacher_in_checkpoint``: the restored teacher is the trained run's (seed 1)."""
    strategy = _strategy(sizes)
    trainer = Trainer(**_trainer_options(int(os.environ["WORLD_SIZE"]), strategy=strategy,
                                         max_steps=3))  # fmt: skip
    module = TeacherModule(teacher_seed=2)
    module.save_teacher_in_checkpoint = True
    trainer.fit(module, DataLoader(RolloutRows(2 * BATCH), batch_size=BATCH), ckpt_path=path)
    pairs = zip(_values(module.teacher_chunks), _values(trained.teacher_chunks), strict=True)
    restored = trainer.global_step == 3 and all(torch.equal(a, b) for a, b in pairs)
    topk = module.teacher_topk[-1]
    return restored and all(
        torch.equal(a, b) for a, b in zip(topk, trained.teacher_topk[0], strict=True)
    )


class _RankZeroTeacher(TeacherModule):
    """A teacher on global rank 0 only (DP=2: rank 1's ``build_teacher_chunk`` returns None)."""

    def build_teacher_chunk(self, vp_stage: int | None) -> torch.nn.Module | None:
        import torch.distributed as dist

        return super().build_teacher_chunk(vp_stage) if dist.get_rank() == 0 else None


def partial_teacher_rank(rank: int) -> str:
    """The error a fit with a teacher on rank 0 only raises on this rank (``""``: none)."""
    trainer = Trainer(**_trainer_options(2, strategy=_strategy((1, 1)), max_steps=1))
    try:
        trainer.fit(_RankZeroTeacher(1), DataLoader(RolloutRows(2 * BATCH), batch_size=BATCH))
    except ValueError as err:
        return str(err)
    return ""
