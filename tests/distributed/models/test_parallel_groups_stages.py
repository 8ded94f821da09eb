"""``ParallelGroups.is_first_stage`` / ``is_last_stage`` (what the model builders read instead
of megatron's ``parallel_state``) agree with megatron's ``is_pipeline_first_stage`` /
``is_pipeline_last_stage(ignore_virtual=False, vp_stage=...)`` at PP=2 x VPP=2 and PP=2, and
``tiny_gpt(groups=...)`` builds chunks with those flags."""

from __future__ import annotations

from _stage_ranks import stage_flags

from lightning_mcore_rl.testing import run_on_ranks

EXPECTED = {  # rank -> layout -> (first, last) per vp_stage (None, 0, 1 without VPP)
    0: {"vpp=2": [(True, False), (False, False)], "vpp=None": [(True, False)] * 3},
    1: {"vpp=2": [(False, False), (False, True)], "vpp=None": [(False, True)] * 3},
}


def test_stage_flags_match_megatron_and_the_built_chunks():
    results = run_on_ranks(stage_flags, 2)
    for rank, result in enumerate(results):
        for layout, flags in result.items():
            assert flags["ours"] == flags["megatron"] == EXPECTED[rank][layout], (rank, layout)
            expected_chunks = EXPECTED[rank][layout][: 2 if layout == "vpp=2" else 1]
            assert flags["chunks"] == expected_chunks, (rank, layout)
