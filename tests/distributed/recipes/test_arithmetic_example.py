"""Smoke run of ``examples/arithmetic/run.py`` (the whole pipeline, two CPU ranks per training
stage) with a few steps of each stage: it prints each stage's progress, writes the summary, the
SFT and GRPO exports load with ``transformers``, GRPO moved the weights, and the summary's
accuracies are ``evaluate_hf``'s (at the run's one thread) of the exports on the held-out split. The full run (its accuracy gain) is
``.venv/bin/python examples/arithmetic/run.py --seed 0 --out outputs/arithmetic/seed0``
(numbers in BENCHMARKS.md)."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_mcore_rl.recipes import evaluate_hf, make_splits

RUN = Path(__file__).parents[3] / "examples" / "arithmetic" / "run.py"
SMOKE = [
    "--seed", "3", "--train-problems", "64", "--val-problems", "16", "--sft-steps", "2",
    "--sft-batch", "8", "--grpo-steps", "2", "--grpo-prompts", "4", "--group-size", "2",
]  # fmt: skip


@pytest.mark.timeout(300)
def test_pipeline_smoke(tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    command = [sys.executable, str(RUN), *SMOKE, "--out", str(out)]
    printed = subprocess.run(command, check=True, timeout=280, capture_output=True, text=True)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["seconds"]) == {"prepare", "sft", "eval_sft", "grpo", "eval_grpo"}
    progress = re.findall(r"^\[(?:sft|grpo|eval)\] .*$", printed.stdout, re.MULTILINE)
    expected = [
        line.format(stage=stage, hf=out / stage / "hf", accuracy=summary[f"{stage}_accuracy"])
        for stage in ("sft", "grpo")
        for line in (
            "[{stage}] launching 2 ranks",
            "[{stage}] step 1/2 (50%)",
            "[{stage}] step 2/2 (100%)",
            "[eval] {hf}: greedy accuracy {accuracy:.3f} on 16 problems",
        )
    ]
    assert [line.split("  ")[0] for line in progress] == expected
    values = r"  train_loss \S+  [\d.]+ s/step, \d+ s left"
    assert all(re.fullmatch(r"\[sft\] .*%\)" + values, line) for line in progress[1:3])
    assert all(re.fullmatch(r"\[grpo\] .*%\)  reward \S+" + values, line) for line in progress[5:7])
    _, val = make_splits(64, 16, seed=3)
    assert summary["val_problems"] == 16
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for stage in ("sft", "grpo"):
            assert summary[f"{stage}_accuracy"] == evaluate_hf(out / stage / "hf", val, 4)
    finally:
        torch.set_num_threads(threads)
    rows = list(csv.DictReader((out / "grpo" / "metrics.csv").open()))
    assert len(rows) == 2 and all(0 <= float(r["reward"]) <= 1 for r in rows)
    assert all(math.isfinite(float(r["train_loss"])) for r in rows)
    sft, grpo = (
        AutoModelForCausalLM.from_pretrained(out / stage / "hf").state_dict()
        for stage in ("sft", "grpo")
    )
    assert sft.keys() == grpo.keys()
    assert any(not torch.equal(sft[k], grpo[k]) for k in sft)


def test_pipeline_refuses_a_used_directory_and_helps_in_full_sentences(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("arithmetic_run", RUN)
    assert spec is not None and spec.loader is not None
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(FileExistsError, match="is not empty; give a new directory"):
        run.main(["--out", str(tmp_path)])
    with pytest.raises(SystemExit):
        run.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "evaluated with transformers before and after GRPO. options:" in text
    assert "--grpo-steps GRPO_STEPS GRPO optimizer steps (default: 300)" in text
    assert "--backend {hf,vllm} GRPO rollout backend; vllm: run with .venv-vllm's python" in text


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_backend_without_vllm_fails_before_any_stage(tmp_path):
    """``--backend vllm`` where vLLM is not installed raises naming the install before the data
    or the SFT stage are made (the run itself: ``tests/distributed/rollout/test_vllm_examples.py``,
    in ``.venv-vllm``)."""
    spec = importlib.util.spec_from_file_location("arithmetic_run", RUN)
    assert spec is not None and spec.loader is not None
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    with pytest.raises(ImportError, match=r"backend='vllm' needs vLLM.*scripts/bootstrap_vllm.sh"):
        run.main(["--backend", "vllm", "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run").exists()


MARGIN = 0.10
"""The acceptance margin: GRPO's held-out greedy accuracy above the SFT model's, per seed. Below
the smallest gain measured on a 2-core Intel Xeon (+0.137 to +0.375 over seeds 0 and 1 with
torch's AVX-512 and AVX2 kernels and MKL's AVX2 path, +0.109 with the earlier thread setting):
the gain moves by up to 0.13 with the rounding of the CPU's kernels."""


@pytest.mark.skipif(
    not os.environ.get("LMRL_SLOW"),
    reason="the full example, 2-6 min per seed: LMRL_SLOW=1 .venv/bin/pytest "
    "tests/distributed/recipes/test_arithmetic_example.py -k accuracy",
)
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("seed", [0, 1])
def test_full_run_raises_accuracy_by_the_margin(tmp_path, seed):
    """The default run (150 SFT steps, 300 GRPO steps): GRPO raises the held-out accuracy by at
    least ``MARGIN`` (measured on seeds 0 / 1: +0.137 / +0.250 with AVX-512 kernels, +0.258 /
    +0.375 with ``ATEN_CPU_CAPABILITY=avx2``)."""
    out = tmp_path / "run"
    subprocess.run(
        [sys.executable, str(RUN), "--seed", str(seed), "--out", str(out)], check=True, timeout=1700
    )
    summary = json.loads((out / "summary.json").read_text())
    print(f"seed {seed}: {summary['sft_accuracy']:.3f} -> {summary['grpo_accuracy']:.3f}")
    assert summary["grpo_accuracy"] - summary["sft_accuracy"] >= MARGIN
