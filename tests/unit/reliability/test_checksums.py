"""Checkpoint checksums and corrupt-file messages, in one process (no process group): the
manifest against ``zlib.crc32`` of the whole file, each kind of damage named, the diagnosis of
a checkpoint without checksums on a real torch distributed checkpoint, a dangling ``last``."""

from __future__ import annotations

import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_mcore_rl.reliability.checksums import (
    MANIFEST,
    CorruptCheckpointError,
    damaged_files,
    file_crc32,
    shares,
    verify,
    write_manifest,
)
from lightning_mcore_rl.strategy import checkpoint as ckpt


def _files(directory: Path) -> dict[str, bytes]:
    contents = {
        "__0_0.distcp": bytes(range(256)) * 40_000,  # 10.24 MB: two 8 MiB read blocks
        "common.pt": b"common",
        "sub/part.bin": b"\x00" * 17,
    }
    for name, data in contents.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    return contents


def test_the_manifest_records_each_file_size_and_crc32(tmp_path):
    contents = _files(tmp_path)
    write_manifest(tmp_path)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["algorithm"] == "crc32"
    assert manifest["files"] == {
        name: {"bytes": len(data), "crc32": f"0x{zlib.crc32(data):08x}"}
        for name, data in sorted(contents.items())
    }
    assert not list(tmp_path.glob(f".{MANIFEST}*"))  # no temporary manifest left
    assert verify(tmp_path) is True


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            "flip",
            r"__0_0\.distcp: CRC-32 0x[0-9a-f]{8} differs from the recorded 0x[0-9a-f]{8} "
            r"\(same size: its content changed\)",
        ),
        (
            "truncate",
            r"__0_0\.distcp: 5000000 bytes, checksums\.json records 10240000 "
            r"\(truncated\)",
        ),
        ("extend", r"common\.pt: 7 bytes, checksums\.json records 6 \(longer than saved\)"),
        ("remove", r"sub/part\.bin: missing \(checksums\.json records 17 bytes\)"),
        ("manifest", r"checksums\.json: cannot be parsed \(JSONDecodeError"),
    ],
)
def test_each_damaged_file_is_named(tmp_path, damage, message):
    _files(tmp_path)
    write_manifest(tmp_path)
    shard = tmp_path / "__0_0.distcp"
    if damage == "flip":
        with open(shard, "r+b") as f:
            f.seek(9_000_000)  # in the second read block
            byte = f.read(1)[0]
            f.seek(9_000_000)
            f.write(bytes([byte ^ 0x80]))
    elif damage == "truncate":
        os.truncate(shard, 5_000_000)
    elif damage == "extend":
        (tmp_path / "common.pt").write_bytes(b"common!")
    elif damage == "remove":
        (tmp_path / "sub/part.bin").unlink()
    else:
        (tmp_path / MANIFEST).write_text('{"algorithm": "crc32", "files": {')
    pattern = rf"Checkpoint {tmp_path} is damaged and was not loaded: {message}.*another checkpoint"
    with pytest.raises(CorruptCheckpointError, match=pattern):
        verify(tmp_path)


def test_a_checkpoint_without_checksums_loads_unverified_with_a_warning(tmp_path):
    _files(tmp_path)
    with pytest.warns(UserWarning, match=rf"{tmp_path} has no checksums\.json .* unverified"):
        assert verify(tmp_path) is False


def test_file_crc32_equals_zlib_over_the_whole_file(tmp_path):
    data = bytes(range(251)) * 70_000  # 17.57 MB: 3 read blocks, the last one partial
    (tmp_path / "f").write_bytes(data)
    assert file_crc32(tmp_path / "f") == f"0x{zlib.crc32(data):08x}"


def test_shares_balance_the_bytes_and_list_every_file_once():
    sizes = {"a": 10, "b": 7, "c": 5, "d": 3, "e": 3}
    # largest first to the least-loaded rank: a->0, b->1, c->1 (7 < 10), d->0 (10 < 12),
    # e->1 (12 < 13); bytes per rank 13 and 15
    assert shares(sizes, 2) == [["a", "d"], ["b", "c", "e"]]
    assert shares(sizes, 1) == [["a", "b", "c", "d", "e"]]
    assert shares({"a": 1}, 3) == [["a"], [], []]


@dataclass
class _UserHparams:
    lr: float


def _torch_checkpoint(directory: Path, common: object) -> None:
    """A real torch distributed checkpoint (``.metadata``, one ``.distcp`` shard) and a
    ``common.pt``, as megatron's ``torch_dist`` format writes them."""
    state = {"w": torch.arange(4096, dtype=torch.float32), "b": torch.ones(8)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)), no_dist=True)
    torch.save(common, directory / "common.pt")


_SINGLE_PROCESS = "ignore:torch.distributed is disabled:UserWarning"  # dcp.save(no_dist=True)


@pytest.mark.filterwarnings(_SINGLE_PROCESS)
def test_damaged_files_names_what_torch_cannot_read(tmp_path):
    _torch_checkpoint(tmp_path, {"epoch": 1})
    assert damaged_files(tmp_path) == []
    [shard] = [p for p in tmp_path.iterdir() if p.suffix == ".distcp"]
    needed = shard.stat().st_size
    os.truncate(shard, 1000)
    (tmp_path / "common.pt").write_bytes(b"\x07garbage")
    problems = damaged_files(tmp_path)
    assert problems == [
        "common.pt: cannot be unpickled (UnpicklingError: Unsupported operand 7)",
        f"{shard.name}: 1000 bytes, .metadata records data up to byte {needed} (truncated)",
    ]
    assert "weights_only" not in " ".join(problems)  # torch's advice to unpickle unsafely
    shard.unlink()
    (tmp_path / "common.pt").unlink()
    assert damaged_files(tmp_path) == [
        "common.pt: missing",
        f"{shard.name}: missing (.metadata records data in it)",
    ]
    (tmp_path / ".metadata").write_bytes(b"not a pickle")
    [problem] = damaged_files(tmp_path)[1:]
    assert problem.startswith(".metadata: cannot be read (")


@pytest.mark.filterwarnings(_SINGLE_PROCESS)
def test_a_type_not_allowed_in_common_pt_is_not_damage(tmp_path):
    _torch_checkpoint(tmp_path, {"hparams": _UserHparams(lr=0.1)})
    assert damaged_files(tmp_path) == []  # torch's own error for the type stands
    with torch.serialization.safe_globals([_UserHparams]):
        assert damaged_files(tmp_path) == []


def _complete(path: Path) -> Path:
    path.mkdir()
    (path / "metadata.json").write_text("{}")
    return path


def test_a_dangling_last_is_an_error_not_a_fresh_start(tmp_path):
    ckpt.check_last(tmp_path / "absent")  # first launch: no directory yet
    ckpt.check_last(tmp_path)  # an empty directory: first launch too
    (tmp_path / "last.ckpt").symlink_to(tmp_path / "step=4.ckpt")
    with pytest.raises(
        FileNotFoundError,
        match=(
            rf'`ckpt_path="last"` found no loadable last checkpoint in {tmp_path}: last\.ckpt is a '
            rf"symlink to {tmp_path}/step=4\.ckpt, which does not exist\. Resuming from none would "
            r"silently start over: restore it, or remove it to start from step 0\."
        ),
    ):
        ckpt.check_last(tmp_path)
    step2 = _complete(tmp_path / "step=2.ckpt")
    with pytest.raises(FileNotFoundError, match=rf'e\.g\. `ckpt_path="{step2}"`'):
        ckpt.check_last(tmp_path)
    (tmp_path / "step=4.ckpt").mkdir()  # the link's target exists, without metadata.json
    with pytest.raises(FileNotFoundError, match=r"step=4\.ckpt, which is not a complete"):
        ckpt.check_last(tmp_path)
    (tmp_path / "last.ckpt").unlink()
    (tmp_path / "last.ckpt").mkdir()
    (tmp_path / "last-v1.ckpt").write_bytes(b"")
    with pytest.raises(
        FileNotFoundError,
        match=r"last-v1\.ckpt is a file, not a dist_checkpoint"
        r"ing directory; last\.ckpt has no metadata\.json \(an unfinished save\)",
    ):
        ckpt.check_last(tmp_path)
    (tmp_path / "last.ckpt").rmdir()
    _complete(tmp_path / "last.ckpt")
    ckpt.check_last(tmp_path)  # one complete last: Lightning resolves to it
