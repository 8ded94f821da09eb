"""A mistake the run's set-up refuses on both ranks of ``lmrl fit`` prints one line (rank 0's
``lmrl: error: ...``) and exits 2, instead of one traceback per rank; other errors print one
traceback (rank 0's) and a pointer line per other rank (the hook's unit test below). A real
two-process run of the console script (Lightning's own launcher starts rank 1), a config whose
prompts do not split over DP=2, waited on while it makes progress (``_processes.run_processes``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from _processes import run_processes

from lightning_mcore_rl.rank_errors import ALL_TRACEBACKS_ENV, RankExceptHook, pointer_line

CONFIG = Path(__file__).parents[3] / "examples" / "configs" / "grpo_tiny.yaml"
ERROR = "`prompts_per_step` (5) must be divisible by the data-parallel size (2)."


@pytest.mark.timeout(600)  # measured 47 s idle, 104-107 s at load 8-21, > 110 s at 20 (2 cores)
def test_lmrl_prints_one_line_for_a_setup_refusal_on_every_rank(tmp_path):
    lmrl = Path(sys.executable).with_name("lmrl")
    command = [
        str(lmrl), "fit", "--config", str(CONFIG),
        "--trainer.strategy.init_args.tensor_model_parallel_size=1",  # DP = 2
        "--data.init_args.prompts_per_step=5",
        "--trainer.logger=false", "--trainer.callbacks=null",
        "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    env.pop(ALL_TRACEBACKS_ENV, None)
    done = run_processes(tmp_path / "output", [(command, env)], cwd=tmp_path)
    stderr = done.stderrs[0]
    assert done.returncodes == [2], stderr[-3000:]
    lines = stderr.splitlines()
    assert not any("Traceback (most recent call last)" in line for line in lines), stderr
    assert [line for line in lines if line.startswith("lmrl:")] == [f"lmrl: error: {ERROR}"]


def test_rank_hook_prints_a_pointer_off_rank_zero_and_everything_on_request(monkeypatch, capsys):
    seen: list[BaseException] = []
    hook = RankExceptHook(lambda kind, error, traceback: seen.append(error))
    error = ValueError("first line\nsecond line")
    monkeypatch.setattr("lightning_mcore_rl.rank_errors.current_rank", lambda: 1)
    hook(ValueError, error, None)
    assert capsys.readouterr().err == pointer_line(1, error) + "\n" and not seen
    assert pointer_line(1, error).startswith("rank 1: ValueError: first line — see rank 0's")
    monkeypatch.setenv(ALL_TRACEBACKS_ENV, "1")
    hook(ValueError, error, None)
    assert seen == [error]
    monkeypatch.setattr("lightning_mcore_rl.rank_errors.current_rank", lambda: 0)
    monkeypatch.delenv(ALL_TRACEBACKS_ENV)
    hook(ValueError, error, None)
    assert seen == [error, error] and capsys.readouterr().err == ""
