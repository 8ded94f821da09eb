"""Slice-wise reading of a Hugging Face safetensors checkpoint (single file or sharded with an
index), and writing one in `transformers`' shard layout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

_INDEX = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")
_WEIGHT_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


class SafetensorsReader:
    """Names, shapes and dtypes of every tensor in `directory`'s safetensors files, and slice reads.

    Raises:
        FileNotFoundError: no `*.safetensors` file (or the index names a missing file).
        ValueError: a tensor name appears in two files.
    """

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        self.directory = Path(directory)
        index = self.directory / _INDEX
        if index.exists():
            # the index decides which files belong to the checkpoint (a directory may hold others)
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = sorted({self.directory / f for f in weight_map.values()})
        else:
            files = sorted(self.directory.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(
                f"No *.safetensors weights in {self.directory} (PyTorch .bin checkpoints are not "
                "supported; re-save with `save_pretrained(..., safe_serialization=True)`)."
            )
        self._file_of: dict[str, Path] = {}
        self._shape: dict[str, tuple[int, ...]] = {}
        self._dtype: dict[str, torch.dtype] = {}
        for path in files:
            if not path.exists():
                raise FileNotFoundError(f"{index} names {path.name}, which does not exist.")
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    if name in self._file_of:
                        raise ValueError(
                            f"Tensor {name!r} is in both {self._file_of[name].name} and {path.name}."
                        )
                    piece = handle.get_slice(name)
                    self._file_of[name] = path
                    self._shape[name] = tuple(piece.get_shape())
                    self._dtype[name] = _DTYPES[piece.get_dtype()]

    def names(self) -> list[str]:
        """All tensor names, sorted."""
        return sorted(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        """Full shape of tensor ``name``."""
        return self._shape[name]

    def dtype(self, name: str) -> torch.dtype:
        """Stored dtype of tensor ``name``."""
        return self._dtype[name]

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None) -> torch.Tensor:
        """``tensor[rows, cols]`` (``None`` = all) read from disk without loading the rest."""
        from safetensors import safe_open

        # `get_slice` reads only the requested bytes: a rank reads only the rows/columns it keeps
        with safe_open(str(self._file_of[name]), framework="pt") as handle:
            piece = handle.get_slice(name)
            if cols is not None:
                return piece[rows or slice(None), cols]
            if rows is not None:
                return piece[rows]
            return piece[:]


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def save_safetensors(
    tensors: dict[str, torch.Tensor], path: str | os.PathLike[str], metadata: dict[str, str]
) -> None:
    """`safetensors.torch.save_file`, leaving `path` mode `0o666` less the umask."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    # safetensors creates the file 0o600 whatever the umask: readers other than the owner (a
    # serving process, a shared model directory) could not load the export
    os.chmod(path, 0o666 & ~current_umask())


def current_umask() -> int:
    """The process's umask (read by setting it and restoring it at once)."""
    # the umask can only be read by setting it: restore it at once
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def is_weight_file(name: str) -> bool:
    """Whether a file called ``name`` holds (or indexes) model weights."""
    return name.endswith(_WEIGHT_SUFFIXES) or name in _WEIGHT_FILES


def existing_weights(out: Path) -> str | None:
    """Why ``out`` cannot receive a model (it holds weight files), or ``None``."""
    if out.is_dir() and any(is_weight_file(p.name) for p in out.iterdir()):
        return f"{out} already holds model weights; save into a new or empty directory."
    return None


class ShardWriter:
    """Accumulate tensors into safetensors shards of at most ``max_bytes`` (a single larger
    tensor gets its own shard); ``close`` names them as ``transformers`` does."""

    def __init__(self, out: Path, max_bytes: int) -> None:
        self.out = out
        self.max_bytes = max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        # a single tensor larger than `max_bytes` gets its own shard
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[name] = tensor
        self.pending_bytes += size

    def _flush(self) -> None:
        save_safetensors(self.pending, self._part(len(self.shards)), metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def _part(self, index: int) -> Path:
        # temporary names until `close` renames them: an interrupted export leaves no directory that
        # looks complete
        return self.out / f".part-{index:05d}.safetensors.tmp"

    def close(self) -> None:
        if self.pending:
            self._flush()
        count = len(self.shards)
        # named as `transformers` names them: one file, or numbered shards and an index
        if count == 1:
            os.replace(self._part(0), self.out / "model.safetensors")
            return
        weight_map: dict[str, str] = {}
        for index, names in enumerate(self.shards):
            file = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
            os.replace(self._part(index), self.out / file)
            weight_map.update(dict.fromkeys(names, file))
        index_json = {"metadata": {}, "weight_map": weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=2))
