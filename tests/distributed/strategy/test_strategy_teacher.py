"""A frozen teacher hosted by ``MCoreRLModule.build_teacher_chunk`` under a Trainer (CPU, gloo,
fp32 tiny GPT).

* teacher = student (the same seed-0 weights): the top-k distillation loss and the full-vocabulary
  OPD loss with the "logits" and the "hidden_states" payload are 0 at TP=2, PP=2 and DP=2 (DP=2
  also under bf16-mixed);
* a different teacher (seed 1): each loss equals plain torch on the logits of the same
  layout-invariant tiny GPTs built at TP=1 and called directly (no schedule, no post-processor,
  no TP: ``_hook_runs.reference_forward``) at DP=2, PP=2 and TP=2 with sequence parallelism (the
  hidden-state payload gathered over TP along the sequence); the teacher's top-k equals
  ``torch.topk`` and its logprobs ``log_softmax``;
* the teacher stays frozen: eval mode, ``requires_grad=False``, parameters unchanged after two
  optimizer steps (the student's change), outside the optimizer and ``module.parameters()``,
  and in a checkpoint only with ``save_teacher_in_checkpoint`` (a resume with it restores the
  teacher); ``load_dist_checkpoint`` reads the student's or the saved teacher's weights into a
  teacher chunk.

One spawned process group per layout (TP=2, PP=2, DP=2) runs every fit; the tests read its
results.

Measured: teacher = student losses 0.0 exactly; another teacher's losses within 1.2e-8 of plain
torch, its top-k values within 2.1e-7 (TP=2; 0 at PP=2 and DP=2), its
``compute_logprobs(teacher=True)`` within 9.6e-7.
"""

from __future__ import annotations

import pytest
import torch
from _hook_runs import probe_batch
from _strategy_teacher_runs import LOSSES, TeacherFit, partial_teacher_rank, teacher_rank
from test_module_hooks import reference_logprobs
from torch import Tensor

from lightning_mcore_rl.strategy.teacher import (
    TEACHER_CHECKPOINT_PREFIX,
    HostedTeacher,
    build_teacher_chunks,
    load_dist_checkpoint,
)
from lightning_mcore_rl.testing import run_on_ranks

ZERO_TOL = 1e-6
LAYOUTS = {"tp": (2, 1, 1), "pp": (1, 2, 1), "dp": (1, 1, 2)}  # (TP, PP, DP)
TOL = 1e-5
K = 5

TP2_FITS = {  # the other teacher under SP: its hidden-state payload is gathered over TP
    "same": TeacherFit(teacher_seed=0),
    "other": TeacherFit(teacher_seed=1, sequence_parallel=True),
}
PP2_FITS = {  # results broadcast from the last stage; its LM head projects the hidden states
    "same": TeacherFit(teacher_seed=0),
    "other": TeacherFit(teacher_seed=1),
}
DP2_FITS = {
    "same": TeacherFit(teacher_seed=0),
    "same_bf16": TeacherFit(teacher_seed=0, bf16=True),
    "other": TeacherFit(teacher_seed=1, checkpoints=True),
}


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("teacher_tp2"))
    return run_on_ranks(teacher_rank, 2, (2, 1), TP2_FITS, directory, timeout=240)


@pytest.fixture(scope="module")
def dp_runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("teacher_dp2"))
    return run_on_ranks(teacher_rank, 2, (1, 1), DP2_FITS, directory, timeout=240)


@pytest.fixture(scope="module")
def pp_runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("teacher_pp2"))
    return run_on_ranks(teacher_rank, 2, (1, 2), PP2_FITS, directory, timeout=240)


def reference_losses(student: Tensor, teacher: Tensor) -> dict[str, float]:
    """Step-0 losses by plain torch from the full ``[B, S, V]`` logits: the token mean over
    ``token_mask[:, 1:]`` (all samples valid; logits at t score token t+1) of the mixed (w = 0.5)
    top-k KL over the teacher's top-K ids (both log-softmaxed over them) and of the full-vocabulary
    reverse KL ``sum_v p_s (log p_s - log p_t)`` (both payloads: the hidden-state payload times
    the output weight is the teacher's logits)."""
    mask = probe_batch()["token_mask"][:, 1:].double()  # [B, S-1]
    s_all, t_all = student[:, :-1].double(), teacher[:, :-1].double()  # [B, S-1, V]
    values, top = t_all.topk(K, dim=-1)
    t = values.log_softmax(-1)
    s = s_all.gather(-1, top).log_softmax(-1)
    topk = 0.5 * (t.exp() * (t - s)).sum(-1) + 0.5 * (s.exp() * (s - t)).sum(-1)
    log_ps, log_pt = s_all.log_softmax(-1), t_all.log_softmax(-1)
    reverse = (log_ps.exp() * (log_ps - log_pt)).sum(-1)
    mean = lambda x: float((x * mask).sum() / mask.sum())  # noqa: E731
    return {"topk": mean(topk), "logits": mean(reverse), "hidden_states": mean(reverse)}


def _max_diff(a: Tensor, b: Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("layout", ["tp", "pp", "dp"], ids=["tp2", "pp2", "dp2"])
def test_teacher_equal_to_student_gives_zero_losses(layout, request):
    runs = request.getfixturevalue(f"{layout}_runs")
    names = [n for n in runs[0] if n.startswith("same")]
    for rank_runs in runs:
        for name in names:
            losses = rank_runs[name].losses
            print(f"{layout} {name}: teacher = student losses {losses}")
            assert rank_runs[name].layout == LAYOUTS[layout]
            assert set(losses) == set(LOSSES)
            assert max(abs(v) for v in losses.values()) <= ZERO_TOL


@pytest.mark.parametrize("layout", ["tp", "pp", "dp"], ids=["tp2", "pp2", "dp2"])
def test_other_teacher_matches_plain_torch(layout, request):
    for rank_runs in request.getfixturevalue(f"{layout}_runs"):
        run = rank_runs["other"]
        assert run.layout == LAYOUTS[layout]
        expected = reference_losses(run.student.logits, run.teacher.logits)
        diffs = {k: abs(run.losses[k] - expected[k]) for k in LOSSES}
        print(f"{layout} other teacher: losses {run.losses}, |diff| to plain torch {diffs}")
        assert min(expected.values()) > 1e-3  # a real divergence, not 0
        assert max(diffs.values()) <= TOL
        # the teacher's top-k (ids untied by > TOL in every row here) and its step-0 loss
        values, indices = run.teacher_topk[0]
        ref_values, ref_indices = run.teacher.logits.topk(K, dim=-1)
        d_topk = _max_diff(values, ref_values)
        print(f"{layout} other teacher: top-k values max diff to torch.topk {d_topk:.2e}")
        assert d_topk <= TOL and torch.equal(indices, ref_indices)
        assert run.teacher_logprobs is not None  # compute_logprobs(teacher=True), T = 1
        d_lp = _max_diff(run.teacher_logprobs, reference_logprobs(run.teacher.logits, run.ids, 1.0))
        print(f"{layout} other teacher: compute_logprobs(teacher=True) max diff {d_lp:.2e}")
        assert d_lp <= TOL
        assert run.rows[0]["train_loss"] == pytest.approx(expected["logits"], abs=TOL)


@pytest.mark.parametrize("layout", ["tp", "pp", "dp"], ids=["tp2", "pp2", "dp2"])
def test_teacher_stays_frozen_and_outside_the_optimizer(layout, request):
    for rank_runs in request.getfixturevalue(f"{layout}_runs"):
        for name, run in rank_runs.items():
            if name == "loaded":
                continue
            assert run.teacher_modes and not any(run.teacher_modes), name  # eval, in training
            assert run.teacher_requires_grad and not any(run.teacher_requires_grad), name
            assert run.teacher_unchanged, name
            assert run.optimizer_params > 0 and run.optimizer_overlap == 0, name
            assert not run.teacher_in_parameters, name
            # no megatron DDP around the teacher; Float16Module only under bf16
            assert run.teacher_wrappers == ["Float16Module" if "bf16" in name else "GPTModel"]
            assert len(run.teacher_topk) == len(run.rows) == 2, name
        other = rank_runs["other"]
        assert other.student_changed  # the student trained, the teacher did not
        (v0, i0), (v1, i1) = other.teacher_topk
        assert torch.equal(v0, v1) and torch.equal(i0, i1)
        assert _max_diff(other.student_logprobs[0], other.student_logprobs[1]) > 1e-4


def test_teacher_is_checkpointed_only_when_asked(dp_runs):
    for rank_runs in dp_runs:
        keys = rank_runs["other"].checkpoint_keys
        teacher = [k for k in keys["with_teacher"] if k.startswith(TEACHER_CHECKPOINT_PREFIX)]
        print(f"checkpoint keys: {len(keys['student_only'])} without, {len(teacher)} teacher keys")
        assert not any(k.startswith(TEACHER_CHECKPOINT_PREFIX) for k in keys["student_only"])
        # the teacher's weights under the student's model keys, prefixed (optimizer state: not)
        model = [k for k in keys["student_only"] if not k.startswith("optimizer.")]
        assert model and teacher == [TEACHER_CHECKPOINT_PREFIX + k for k in model]
        assert sorted(set(keys["with_teacher"]) - set(teacher)) == keys["student_only"]
        # load_dist_checkpoint: the trained student (prefix "") and the saved teacher ("teacher.")
        assert rank_runs["loaded"] == {"student_only": True, "with_teacher": True, "resumed": True}


# ---------------------------------------------------------------- errors (no process group)


def test_teacher_true_without_a_teacher_raises():
    with pytest.raises(ValueError, match=r"`teacher=True` but the module hosts no teacher"):
        HostedTeacher().select(True, [])


def test_a_teacher_for_some_stages_only_raises():
    with pytest.raises(ValueError, match=r"returned None for vp_stage\(s\) \[1\]"):
        build_teacher_chunks(lambda stage: torch.nn.Linear(2, 2) if stage == 0 else None, [0, 1])
    assert build_teacher_chunks(lambda stage: None, [0, 1]) is None
    (chunk,) = build_teacher_chunks(lambda stage: torch.nn.Linear(2, 2).train(), [None]) or []
    assert not chunk.training and not any(p.requires_grad for p in chunk.parameters())


def test_load_dist_checkpoint_of_a_plain_directory_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is not a megatron dist_checkpointing directory"):
        load_dist_checkpoint(torch.nn.Linear(2, 2), tmp_path)


def test_an_unfrozen_teacher_raises():
    class Holder:
        teacher_chunks = [torch.nn.Linear(2, 2)]

    Holder.teacher_chunks[0].config = object()  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"2 of its parameters require grad \(first: 'weight'\)"):
        HostedTeacher().setup(Holder(), [None], {}, bf16=False)


def test_a_teacher_on_some_ranks_only_raises_on_every_rank():
    # rank 1 builds no teacher: both ranks raise at setup instead of hanging in a teacher pass
    for message in run_on_ranks(partial_teacher_rank, 2, timeout=120):
        assert "returned a teacher on some ranks and None on others" in message, message
