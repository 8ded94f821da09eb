"""Exact mid-epoch resume of ``PromptFileDataModule`` at DP=2, through
``Trainer(strategy=MCoreRLStrategy())``: the Trainer matters here, because it saves and restores
the ``ResumableLoader``'s position with the fit loop and the strategy gives the sampler megatron's
data-parallel rank."""

from __future__ import annotations

from _prompt_resume_ranks import addition_rows, resume_rank, write_rows

from lightning_mcore_rl.testing import run_on_ranks


def test_prompt_files_resume_mid_epoch_at_dp2(tmp_path):
    # 24 rows, every 6th too long (14 tokens > max_prompt_length=8): 20 kept, 10 per rank,
    # 2 prompts per rank and step -> epoch 0 = steps 1-5, epoch 1 = steps 6-7
    path = write_rows(addition_rows(24, long_every=6), tmp_path / "train.jsonl")
    results = run_on_ranks(resume_rank, 2, path, str(tmp_path / "ckpts"), timeout=240)
    long_ids = {i for i in range(24) if i % 6 == 5}
    for result in results:
        assert result.num_filtered == 4 and result.dataset_size == 20
        assert len(result.full) == 7 and all(len(step) == 2 for step in result.full)
        # the resumed run continues with the next unseen prompts: steps 4-7 of the full run
        assert result.resumed == result.full[3:]
        assert not set(sum(result.resumed[:2], [])) & set(sum(result.full[:3], []))
    epoch0 = [i for result in results for step in result.full[:5] for i in step]
    # epoch 0: each kept row exactly once over the two ranks, no long row
    assert sorted(epoch0) == sorted(set(range(24)) - long_ids)
    # each DP rank reads its own rows; epoch 1 is a new permutation
    assert results[0].full[0] != results[1].full[0]
    assert results[0].full[5] != results[0].full[0]
