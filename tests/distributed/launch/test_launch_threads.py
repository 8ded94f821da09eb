"""Exact resume whatever thread counts the ranks start with, under Lightning's own launcher.

``_threads_script.py`` runs ``Trainer(devices=2)`` with ``MCoreRLStrategy`` at TP=2 as a script
(Lightning's ``_SubprocessScriptLauncher`` starts rank 1), rank 0 starting with 1 torch
intra-op thread and rank 1 with 2. Without one count on every rank the TP-replicated parameters
(layer norms, position embeddings, row-parallel biases) drift apart: 13 of 15 tensors differed
after 6 steps (max 1.2e-7), and a resume, which loads one saved copy on both ranks, is not the
uninterrupted run. The strategy sets every rank to the smallest count
(``ReliabilityConfig.intra_op_threads=None``), so both are bitwise.

A kill is ``SIGKILL`` to the whole process group (both ranks at once) from inside rank 0 at a
chosen step; the resumed run is ``fit(ckpt_path="last")``. Processes run under
``_processes.run_processes`` (waited on while their output changes, killed on a stall).
"""

from __future__ import annotations

import ast
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _processes import run_processes
from test_launch import LIMIT_S, clean_env

SCRIPT = Path(__file__).with_name("_threads_script.py")
WARNING = "rank 1: torch intra-op threads 2 -> 1"


def launch(
    out: Path, name: str, steps: int, *flags: str, killed: bool = False
) -> tuple[list[Any], str]:
    """Run the script once on ``out`` (``OMP_NUM_THREADS`` set, so Lightning's launcher keeps
    the counts the script sets), waited on through its output in ``out/name`` (the checkpoints,
    whose directories are renamed and removed while a run works, stay out of that folder);
    returns each rank's ``rank{r}.pt`` (none when ``killed``) and the output. A killed run must
    end by ``SIGKILL``, a normal one with 0."""
    cmd = [sys.executable, str(SCRIPT), str(out), f"--steps={steps}", *flags]
    done = run_processes(out / name, [(cmd, clean_env(OMP_NUM_THREADS="2"))])
    output = done.stdouts[0] + done.stderrs[0]
    assert done.returncodes == [-signal.SIGKILL if killed else 0], output[-6000:]
    if killed:
        return [], output
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)], output


def check_printed(output: str, rank: int, reference: list[Any], first: int, saved: int) -> None:
    """The ``(step, loss, grad_norm)`` lines rank ``rank`` printed (exact float reprs) in a run
    started after ``first`` steps and killed after ``saved`` are the reference's next steps, at
    least up to step ``saved``."""
    prefix = f"rank {rank}: step "
    lines = output.splitlines()
    printed = [
        ast.literal_eval(line.removeprefix(prefix)) for line in lines if line.startswith(prefix)
    ]
    assert first + len(printed) >= saved
    assert printed == [tuple(step) for step in reference[first : first + len(printed)]]


def check_replicated_equal(ranks: list[dict[str, Any]]) -> None:
    """Every TP-replicated parameter bitwise equal on both TP ranks, each rank run with 1
    thread after starting with 1 + rank."""
    assert [r["tp_rank"] for r in ranks] == [0, 1]
    assert [r["threads_at_start"] for r in ranks] == [1, 2]
    assert [r["threads_in_step"] for r in ranks] == [1, 1]
    names = ranks[0]["replicated"]
    assert names == ranks[1]["replicated"] and len(names) == 15  # 2 layers of the tiny GPT
    differing = [n for n in names if not torch.equal(ranks[0]["params"][n], ranks[1]["params"][n])]
    assert differing == []


def check_resume_equal(resumed: dict[str, Any], reference: dict[str, Any], saved: int) -> None:
    """The resumed run continues the uninterrupted one bitwise: losses and grad norms of every
    step after the ``saved`` ones, and every parameter at the end."""
    assert resumed["steps"] == reference["steps"][saved:]
    params = reference["params"]
    assert resumed["params"].keys() == params.keys()
    assert [n for n, p in resumed["params"].items() if not torch.equal(p, params[n])] == []


@pytest.mark.timeout(LIMIT_S)
def test_kill_and_resume_is_bitwise_with_different_thread_counts_per_rank(tmp_path: Path):
    """4 steps, the run killed at the start of step 3 (2 saved), resumed; the uninterrupted
    reference runs after the resume in the same processes (their thread counts set apart
    again; its first 2 steps equal the killed run's, which ran in fresh processes)."""
    steps, kill_after = 4, 2
    _, killed = launch(tmp_path, "killed", steps, f"--kill-after={kill_after}", killed=True)
    ranks, output = launch(tmp_path, "resumed", steps, "--resume", "--reference")
    assert WARNING in output and "rank 0: torch intra-op threads" not in output
    for name in ("run", "reference"):
        check_replicated_equal([r[name] for r in ranks])
    for rank, saved in enumerate(ranks):
        reference = saved["reference"]
        check_printed(killed, rank, reference["steps"], 0, kill_after)
        check_resume_equal(saved["run"], reference, kill_after)


@pytest.mark.skipif(
    not os.environ.get("LMRL_SLOW"),
    reason="10 kill-and-resume launches, ~3 min on 2 idle cores: LMRL_SLOW=1 .venv/bin/pytest "
    "tests/distributed/launch/test_launch_threads.py -k ten",
)
@pytest.mark.timeout(3600)
def test_ten_kills_and_resumes_are_bitwise_with_different_thread_counts_per_rank(tmp_path: Path):
    """The acceptance's 10 kill-and-resume runs, chained: an uninterrupted 11-step reference
    (fresh processes); then one run killed after 1 saved step, resumed and killed after 2, ...,
    after 10, resumed to the end. Kills alternate between the start of the next step and its
    end (its update computed, not saved). Every resumed run's steps and the last run's
    parameters are bitwise the reference's."""
    steps = 11
    reference, _ = launch(tmp_path / "reference", "run", steps)
    check_replicated_equal([r["run"] for r in reference])
    out = tmp_path / "killed"
    for kill_after in range(1, steps):
        phase = ("start", "end")[kill_after % 2 == 0]
        flags = [f"--kill-after={kill_after}", f"--kill-phase={phase}"]
        flags += ["--resume"] if kill_after > 1 else []
        _, output = launch(out, f"kill{kill_after}", steps, *flags, killed=True)
        for rank, ref in enumerate(reference):
            check_printed(output, rank, ref["run"]["steps"], kill_after - 1, kill_after)
    ranks, _ = launch(out, "resumed", steps, "--resume")
    check_replicated_equal([r["run"] for r in ranks])
    for saved, ref in zip(ranks, reference, strict=True):
        check_resume_equal(saved["run"], ref["run"], steps - 1)
