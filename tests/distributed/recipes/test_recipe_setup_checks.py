"""A ``micro_batch_size`` that does not divide a recipe's local batch is refused at setup, on
every rank, before the first rollout or forward, naming where the local batch comes from
(the DataModule argument, the DP size and the recipe's rows per item)."""

from __future__ import annotations

import re

from _setup_check_runs import misfit_micro_batches

from lightning_mcore_rl.testing import run_on_ranks

# the one constructor spelling, and the YAML one (the flat keyword is not accepted in YAML)
_MBS = (
    r"`MCoreRLStrategy\(microbatching=MicrobatchConfig\(micro_batch_size={0}\)\)` "
    r"\(YAML: `microbatching: \{{micro_batch_size: {0}\}}`\) "
)
EXPECTED = {
    "grpo": _MBS.format(8) + r"must divide each data-parallel rank's batch "
    r"of 12 rows = PromptDataModule\(prompts_per_step=6\) / data-parallel size 2 x "
    r"GRPOModule\(rollout.group_size=4\)\. Set `micro_batch_size` to a divisor of 12",
    "grpo_dp": r"^`prompts_per_step` \(5\) must be divisible by the data-parallel size \(2\)\.$",
    "distill": _MBS.format(8) + r"must divide each data-parallel rank's "
    r"batch of 12 rows = PromptDataModule\(prompts_per_step=6\) / data-parallel size 2 x "
    r"DistillationModule\(rollout.group_size=4\)\. Set `micro_batch_size` to a divisor of 12",
    "dpo": _MBS.format(4) + r"must divide each data-parallel rank's batch "
    r"of 6 rows = PreferenceDataModule\(pairs_per_step=6\) / data-parallel size 2 x 2 rows per "
    r"chosen/rejected pair\. Set `micro_batch_size` to a divisor of 6, or change "
    r"`pairs_per_step`\.",
    "sft": _MBS.format(4) + r"must divide each data-parallel rank's batch "
    r"of 3 rows = SFTDataModule\(samples_per_step=6\) / data-parallel size 2\. Set",
}


def test_micro_batch_size_not_dividing_the_local_batch_raises_at_setup():
    ranks = run_on_ranks(misfit_micro_batches, 2, timeout=240)
    for name, pattern in EXPECTED.items():
        for rank, result in enumerate(ranks):
            message, batches_started = result[name]
            assert re.search(pattern, message), (name, rank, message)
            assert batches_started == 0, (name, rank)  # refused before the first batch
