#!/usr/bin/env bash
# Set up ./.venv-mcore019 (scripts/bootstrap_mcore019.sh: megatron-core 0.19.2) and run the suite's
# megatron-core 0.19 subset there: every unit test, the Trainer-vs-bare-loop parity at TP=2 and
# PP=2, the GRPO loop at TP=2 vs TP=1, the training step's layout invariance, the seed API, the
# HF bridge's parity with transformers and the MoE layouts (EP=2 included). Extra arguments go
# to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap_mcore019.sh
exec .venv-mcore019/bin/python -m pytest -m "not gpu and not vllm" "$@" \
  tests/unit \
  tests/distributed/strategy/test_strategy_parity.py::test_tp2_matches_bare_loop_and_tp_ranks_read_the_same_batches \
  tests/distributed/strategy/test_strategy_parity.py::test_pp2_1f1b_matches_bare_loop_and_stage0_logs_the_last_stage_loss \
  tests/distributed/recipes/test_grpo_recipe.py::test_tp2_rl_loop_matches_tp1 \
  tests/distributed/train/test_train_step_invariance.py \
  tests/distributed/train/test_seed_api.py \
  tests/distributed/models/test_hf_bridge.py::test_import_matches_transformers_and_round_trips \
  tests/distributed/models/test_moe_layouts.py \
  tests/distributed/strategy/test_strategy_moe.py::test_trainer_grpo_ep2_equals_ep1_and_one_rank
