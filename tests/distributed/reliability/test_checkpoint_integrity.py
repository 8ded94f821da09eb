"""Damaged checkpoints on 2 real ranks: every rank raises an error naming the damaged file (no
silent load, no fresh start, no unsafe advice), through ``fit(ckpt_path="last")`` and the
strategy's ``load_checkpoint``; an intact copy resumes bitwise."""

from __future__ import annotations

from _integrity_runs import SHARD, integrity_rank

from lightning_mcore_rl.testing import run_on_ranks

EXPECTED = {
    # case: (error type, text naming the file and the damage)
    "flip": ("CorruptCheckpointError", f"{SHARD}: CRC-32 0x"),
    "dangling": ("FileNotFoundError", "last.ckpt is a symlink to "),
    "truncate": (
        "CorruptCheckpointError",
        f"{SHARD}: 386984 bytes, checksums.json records 773968 (truncated)",
    ),
    "garbage_common": ("CorruptCheckpointError", "common.pt: CRC-32 0x"),
    # no checksums.json (saved before checksums): found when megatron fails to read it
    "old": (
        "CorruptCheckpointError",
        f"common.pt: cannot be unpickled (UnpicklingError: Unsupported operand 7); {SHARD}: "
        "386984 bytes, .metadata records data up to byte 773968 (truncated)",
    ),
}


def test_damaged_checkpoints_raise_naming_the_file_on_every_rank(tmp_path):
    results = run_on_ranks(integrity_rank, 2, str(tmp_path), timeout=110)
    for rank, out in enumerate(results):
        for case, (kind, text) in EXPECTED.items():
            error = out[case]["error"]
            assert error is not None and error[0] == kind, (rank, case, error)
            assert text in error[1], (rank, case, error[1])
            assert str(tmp_path / case) in error[1], (rank, case, error[1])
            assert "weights_only" not in error[1], (rank, case, error[1])
        assert out["flip"]["steps"] == out["dangling"]["steps"] == [], "no step ran"
        assert "which does not exist" in out["dangling"]["error"][1]
        # the intact copy resumes at step 3, bitwise equal to the uninterrupted run
        assert out["intact"]["error"] is None
        assert out["intact"]["steps"] == out["full"][2:], rank
        # a checkpoint saved before checksums loads unverified: rank 0 warns, once
        told = [len(out[case]["warnings"]) for case in ("old", "intact", "truncate")]
        assert told == ([1, 0, 0] if rank == 0 else [0, 0, 0]), (rank, told)
    for case in EXPECTED:  # the same message on both ranks
        assert results[0][case]["error"] == results[1][case]["error"], case
    print("flip:", results[0]["flip"]["error"][1])
    print("old:", results[0]["old"]["error"][1])
    print("CPU s per rank:", [round(out["cpu_s"], 1) for out in results])
