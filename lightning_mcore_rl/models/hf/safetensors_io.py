"""Slice-wise reading of a Hugging Face safetensors checkpoint (single file or sharded with
``model.safetensors.index.json``): a rank reads only the rows/columns it keeps."""

from __future__ import annotations

import json
from pathlib import Path

import torch

_INDEX = "model.safetensors.index.json"


class SafetensorsReader:
    """Names, shapes and dtypes of every tensor in ``directory``'s safetensors files, and
    slice reads through ``safe_open(...).get_slice`` (only the requested bytes are read).

    Args:
        directory: an HF model directory.

    Raises:
        FileNotFoundError: no ``*.safetensors`` file (or the index names a missing file).
        ValueError: a tensor name appears in two files.
    """

    def __init__(self, directory: str | Path) -> None:
        from safetensors import safe_open

        self.directory = Path(directory)
        index = self.directory / _INDEX
        if index.exists():
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
