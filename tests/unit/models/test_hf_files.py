"""Files the Hugging Face bridge reads and writes: a missing directory named with what is
expected there, and exported safetensors readable as any written file (``0o666`` less the
umask), as one file and as shards."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_mcore_rl.models import HFBridge
from lightning_mcore_rl.models.hf.safetensors_io import ShardWriter, save_safetensors


def test_a_missing_hf_directory_is_named_with_what_it_should_hold(tmp_path):
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(FileNotFoundError) as info:
        HFBridge.from_pretrained(missing)
    message = str(info.value)
    assert message.startswith(f"The Hugging Face model directory {missing} does not exist: ")
    assert "holds config.json and the *.safetensors weights" in message
    with pytest.raises(FileNotFoundError, match=rf"^No config.json in {tmp_path}: a Hugging"):
        HFBridge.from_pretrained(tmp_path)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"weights.bin is a file, not a Hugging Face"):
        HFBridge.from_pretrained(tmp_path / "weights.bin")


@pytest.fixture(params=[0o022, 0o027])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_one_exported_file_honours_the_umask(tmp_path, umask):
    writer = ShardWriter(tmp_path, max_bytes=1 << 20)
    writer.add("a", torch.zeros(4))
    writer.close()
    assert _mode(tmp_path / "model.safetensors") == 0o666 & ~umask  # 0o644 / 0o640, not 0o600


def test_exported_shards_honour_the_umask(tmp_path, umask):
    writer = ShardWriter(tmp_path, max_bytes=16)
    for name in ("a", "b", "c"):
        writer.add(name, torch.zeros(4))
    writer.close()
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) == 3
    assert {_mode(shard) for shard in shards} == {0o666 & ~umask}
    assert _mode(tmp_path / "model.safetensors.index.json") == 0o666 & ~umask


def test_save_safetensors_round_trips(tmp_path, umask):
    from safetensors.torch import load_file

    save_safetensors({"w": torch.arange(3.0)}, tmp_path / "w.safetensors", {"format": "pt"})
    assert torch.equal(load_file(str(tmp_path / "w.safetensors"))["w"], torch.arange(3.0))
    assert _mode(tmp_path / "w.safetensors") == 0o666 & ~umask
