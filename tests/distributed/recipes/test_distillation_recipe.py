"""The on-policy distillation recipe end to end under a Trainer (CPU, gloo, fp32 tiny GPT): the
student samples with the embedded sampler, the hosted teacher scores its samples.

* A teacher trained IN THE TEST with the GRPO recipe (40 steps of 16 prompts x 4 samples from the
  seed-0 tiny GPT, saved with ``trainer.save_checkpoint`` and loaded by ``TeacherSpec.checkpoint``
  through ``load_dist_checkpoint``) is distilled into a seed-1 student: with the full-vocabulary
  hidden-state loss in 30 steps and with the top-k loss (K = 8 of V = 16, mixed KL + tail term) in
  40 steps the student closes at least half of its held-out reward gap to the teacher (measured
  on the same 64 prompts and sampling seeds; the bound's derivation is in the test).
* Teacher = student (the same weights: the tiny GPT's seed, or the same HF directory): every step's
  loss is 0 (<= 1e-6) for the top-k variants (forward, reverse, mixed) and the full-vocabulary
  variants ("logits" and "hidden_states" payloads).
* TP=2 equals TP=1 step by step (sampled rewards exactly, losses within 1e-5, grad norms rel 1e-5)
  for the top-k forward / reverse / mixed + tail and the two full-vocabulary variants, with a
  teacher of another size (1 layer, H_t = 32) and seed; PP=2 likewise for the top-k mixed + tail
  and the two full-vocabulary variants (a 2-layer teacher, one layer per stage); sequence packing
  equals padding at DP=2 for the same three.

Measured (loaded 2-core machine): GRPO teacher val reward 0.998; distilled students 0.996 (full,
30 steps) and 0.9985 (top-k, 40 steps), from 0.24 at step 0 (other seeds and CPU kernels: see the
test); teacher = student losses 0.0; TP=2 vs
TP=1 loss diffs <= 4e-7; PP=2 vs one rank <= 1.9e-6 on losses of ~20 (grad norms rel <= 1.2e-7);
packed vs padded <= 4.8e-6 on losses of ~14 (grad norms rel <= 4.1e-7).
"""

from __future__ import annotations

import csv
import functools
import math
from dataclasses import replace
from pathlib import Path

import pytest
from _distillation_runs import Variant, converge_rank, packing_rank, variants_rank
from _recipe_runs import lmrl_fit

from lightning_mcore_rl.recipes import HFModelSpec, TinyGPTSpec
from lightning_mcore_rl.testing import run_on_ranks

TEACHER_MIN = 0.45
GAP_CLOSED = 0.5
ZERO_TOL = 1e-6
TOL = 1e-5
STEPS = 3
CONVERGE_STEPS = {"grpo": 40, "full": 30, "topk": 40}

PARITY = {
    "topk_forward": Variant(kl_type="forward"),
    "topk_reverse": Variant(kl_type="reverse"),
    "topk_mixed_tail": Variant(tail=True),
    "full_logits": Variant(vocabulary="full"),
    "full_hidden_states": Variant(vocabulary="full", payload="hidden_states"),
}
PP_TEACHER = TinyGPTSpec(num_layers=2, hidden_size=32, num_attention_heads=4, seed=2)
"""A teacher of another size and seed that splits over two pipeline stages (a layer each)."""
PP_PARITY = {
    name: replace(PARITY[name], teacher=PP_TEACHER)
    for name in ("topk_mixed_tail", "full_logits", "full_hidden_states")
}
# Teacher = student: the default student's own weights, at lr = 0. The gradient at the optimum is
# 0 up to rounding (grad norm ~1e-9), but Adam normalises any gradient to a step of size ~lr, so
# with lr > 0 the student would drift off the teacher on rounding noise alone.
SAME = {"teacher": TinyGPTSpec(seed=1), "lr": 0.0}
ZERO = {
    "same_topk_forward": Variant(kl_type="forward", **SAME),
    "same_topk_reverse": Variant(kl_type="reverse", **SAME),
    "same_topk_mixed": Variant(**SAME),
    "same_full_logits": Variant(vocabulary="full", **SAME),
    "same_full_hidden_states": Variant(vocabulary="full", payload="hidden_states", **SAME),
}


def _hf_llama(directory: Path) -> HFModelSpec:
    """A random 2-layer Llama (V = 32 > the task's 16 ids, H = 64) saved to ``directory``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return HFModelSpec(path=str(directory))


@pytest.fixture(scope="module")
def hf_variants(tmp_path_factory) -> dict[str, Variant]:
    """An HF teacher: the same HF model as the student (zero loss), and for the tiny GPT (built
    with the HF vocabulary, V = 32)."""
    hf = _hf_llama(tmp_path_factory.mktemp("hf_llama"))
    return {
        "same_hf_topk_mixed": Variant(student=hf, teacher=hf, lr=0.0),
        "same_hf_full_hidden_states": Variant(
            vocabulary="full", payload="hidden_states", student=hf, teacher=hf, lr=0.0
        ),
        "hf_teacher_full_logits": Variant(vocabulary="full", teacher=hf),
    }


@pytest.fixture(scope="module")
def tp1_runs():
    (runs,) = run_on_ranks(variants_rank, 1, 1, {**PARITY, **ZERO}, STEPS, timeout=240)
    return runs


@pytest.fixture(scope="module")
def tp2_runs(hf_variants):
    variants = {**PARITY, **ZERO, **hf_variants}
    return run_on_ranks(variants_rank, 2, 2, variants, STEPS, timeout=240)


@pytest.mark.timeout(600)  # measured 66 s at load 0.4, 45-155 s at load 17-58 (2 cores)
def test_student_closes_the_gap_to_the_grpo_teacher(tmp_path):
    """The GRPO teacher learns, and each distilled student closes at least ``GAP_CLOSED`` of its
    gap to the teacher: ``(student - start) / (teacher - start)``, held-out rewards, ``start``
    the student's step-0 reward.

    Where a trajectory ends is decided by the sampling (the rollout seed) and by the CPU's
    rounding alike, so the bounds come from the spread over rollout seeds 1234, 1, 2, 3, 4, each
    with torch's default (AVX-512) kernels and with AVX2 ones (``ATEN_CPU_CAPABILITY=avx2
    MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2``): the teacher's held-out reward
    0.527-0.998 (seed 1234: 0.998, AVX2 0.9917 as on an AMD EPYC), hence ``TEACHER_MIN`` 0.45 (a
    random policy scores 0.25); the students' gap closed 0.971-1.154 in 19 of the 20 fits, 0.628
    once (full vocabulary, seed 1: a plateau at 0.51 under a 0.66 teacher); the EPYC's failing
    fit, 0.8472 under 0.9917 from ~0.24, closed ~0.80. ``GAP_CLOSED`` 0.5 sits below all of them.
    """
    (runs,) = run_on_ranks(converge_rank, 1, str(tmp_path), CONVERGE_STEPS, timeout=540)
    grpo = [row["reward"] for row in runs["grpo"].rows]
    print(f"GRPO teacher: reward {grpo[0]:.3f} -> {grpo[-1]:.3f} in {len(grpo)} steps")
    assert len(grpo) == CONVERGE_STEPS["grpo"]
    for name in ("full", "topk"):
        run = runs[name]
        student, teacher = run.final["val_reward"], run.final["val_teacher_reward"]
        start = run.rows[0]["reward"]
        print(
            f"{name}: student reward {start:.3f} at step 0, held-out {student:.4f} after "
            f"{len(run.rows)} steps; teacher held-out {teacher:.4f}"
        )
        assert len(run.rows) == CONVERGE_STEPS[name]
        assert start < 0.4  # a random student: about 1/modulus
        assert teacher >= TEACHER_MIN  # the loaded checkpoint is the trained teacher, not seed 0
        closed = (student - start) / (teacher - start)
        assert closed >= GAP_CLOSED, f"{name}: gap closed {closed:.3f}"


@pytest.mark.parametrize("layout", ["tp1", "tp2"])
def test_teacher_equal_to_student_gives_zero_loss(layout, request):
    runs = request.getfixturevalue(f"{layout}_runs")
    for rank_runs in runs if isinstance(runs, list) else [runs]:
        for name in ZERO:
            rows = rank_runs[name].rows
            losses = [row["train_loss"] for row in rows]
            norms = [row["grad_norm"] for row in rows]
            print(f"{layout} {name}: losses {losses}, grad norms {norms}")
            assert len(losses) == STEPS  # three different rollouts (the sampling seed moves on)
            assert max(abs(v) for v in losses) <= ZERO_TOL, name
            assert max(norms) <= ZERO_TOL, name
        # another teacher: a real divergence, not 0
        assert min(rank_runs[n].rows[0]["train_loss"] for n in PARITY) > 1e-3


def test_hf_teacher(tp2_runs):
    for rank_runs in tp2_runs:
        for name in ("same_hf_topk_mixed", "same_hf_full_hidden_states"):
            rows = rank_runs[name].rows
            losses = [row["train_loss"] for row in rows]
            norms = [row["grad_norm"] for row in rows]
            print(f"HF teacher = HF student, {name}: losses {losses}, grad norms {norms}")
            assert len(losses) == STEPS and max(abs(v) for v in losses) <= ZERO_TOL, name
            assert max(norms) <= ZERO_TOL, name
        losses = [row["train_loss"] for row in rank_runs["hf_teacher_full_logits"].rows]
        print(f"HF teacher, tiny GPT student: losses {losses}")
        assert len(losses) == STEPS and min(losses) > 1e-3


def _assert_parity_per_step(runs: list[dict], reference: dict, names, layout) -> None:
    """Every rank's fits of ``names`` at ``layout`` (TP, PP, DP) equal the single-rank
    ``reference`` step by step: the same sampled rewards, losses within TOL, grad norms rel TOL."""
    for rank_runs in runs:
        for name in names:
            got, want = rank_runs[name], reference[name]
            assert got.layout == layout and want.layout == (1, 1, 1)
            diffs = [
                abs(a["train_loss"] - b["train_loss"])
                for a, b in zip(got.rows, want.rows, strict=True)
            ]
            print(f"{name}: {layout} vs one rank, loss diffs {diffs}")
            assert len(diffs) == STEPS and max(diffs) <= TOL, name
            for a, b in zip(got.rows, want.rows, strict=True):
                assert a["reward"] == b["reward"], name  # the same samples
                assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=TOL), name


def test_tp2_matches_tp1_per_step(tp1_runs, tp2_runs):
    _assert_parity_per_step(tp2_runs, tp1_runs, PARITY, (2, 1, 1))


def test_pp2_matches_pp1_per_step():
    """PP=2 (one layer of the student and of the teacher per stage): the student samples with
    the pipelined embedded sampler, the teacher scores on both stages."""
    (reference,) = run_on_ranks(variants_rank, 1, 1, PP_PARITY, STEPS, timeout=240)
    pp2_rank = functools.partial(variants_rank, pipeline_model_parallel_size=2)
    pp2 = run_on_ranks(pp2_rank, 2, 1, PP_PARITY, STEPS, timeout=240)
    _assert_parity_per_step(pp2, reference, PP_PARITY, (1, 2, 1))


def test_sequence_packing_matches_padding_at_dp2():
    """DP=2: the packed student loss and the teacher's signal on packed microbatches equal the
    padded run's step by step (top-k mixed + tail, full logits, full hidden states)."""
    names = ("topk_mixed_tail", "full_logits", "full_hidden_states")
    variants = {name: PARITY[name] for name in names}
    for padded, packed in run_on_ranks(packing_rank, 2, variants, STEPS, timeout=240):
        for name in names:
            for a, b in zip(packed[name].rows, padded[name].rows, strict=True):
                assert a["reward"] == b["reward"], name  # the same samples
                assert a["train_loss"] == pytest.approx(b["train_loss"], abs=TOL), name
                assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=TOL), name
            assert len(packed[name].rows) == STEPS


def test_lmrl_fit_runs_the_distillation_configs(tmp_path):
    names = ["distill_topk_tiny", "distill_full_tiny"]
    rank0, _ = run_on_ranks(lmrl_fit, 2, str(tmp_path), names, STEPS, timeout=240)
    for name in names:
        rows = list(csv.DictReader(rank0[name]))
        print(f"lmrl fit {name}: train_loss {[row['train_loss'] for row in rows]}")
        assert [int(row["step"]) for row in rows] == list(range(STEPS)), name
        assert all(math.isfinite(float(row["train_loss"])) for row in rows), name
        assert all(0.0 <= float(row["reward"]) <= 1.0 for row in rows), name
