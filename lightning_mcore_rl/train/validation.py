"""The host-side validation of one batch before any collective (`validate_batch`)."""

# Once per pass of `run_global_batch` / `run_forward_only`: a malformed batch raises
# `ValueError` / `TypeError` naming the key; the first non-finite float is returned
# (`NonFinite`) for the caller's non-finite policy.

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

LM_KEYS = ("tokens", "labels")
"""The LM path's batch keys (``[B, S]`` integer ids)."""

PER_TOKEN_KEYS = (
    "advantages",
    "prev_logprobs",
    "generation_logprobs",
    "reference_policy_logprobs",
    "curr_logprobs_unfiltered",
    "returns",
    "values",
)
"""Float ``[B, S]`` loss inputs: their width must be the width of ``input_ids``."""


@dataclass(frozen=True)
class NonFinite:
    """The first non-finite entry of a batch (what the non-finite policy reports)."""

    key: str  # the batch key
    position: tuple[int, ...]  # the index of the first NaN/±inf entry
    value: float  # that entry (`nan`, `inf` or `-inf`)

    def describe(self) -> str:
        """``"`advantages`[1, 4] = inf"``."""
        return f"`{self.key}`{list(self.position)} = {self.value}"


@dataclass(frozen=True)
class BatchSpec:
    """What a batch must look like for one pass."""

    # the LM path (`{"tokens", "labels"}`); otherwise the `loss_fn` path (`input_ids`, ...)
    lm: bool = False
    # `V`: every id (tokens, labels, `input_ids`, top-k indices) must lie in `[0, V)`; `None`
    # skips the check
    vocab_size: int | None = None
    required: tuple[str, ...] = ()  # further keys the pass needs (the loss's, `loss_input_keys`)
    required_by: str | None = None  # who reads `required` (the loss class), named when missing
    needs_lengths: bool = False  # `input_lengths` is required (packing or a token budget)
    # the rows of the model's learned position table (`max_sequence_length`): `S` must not
    # exceed it; `None` (rotary or no positions) skips the check
    max_positions: int | None = None


@dataclass(frozen=True)
class BatchSummary:
    """What the ranks of one model replica compare before a step (one agreement collective)."""

    rows: int  # `B`, the samples of the batch
    width: int  # `S`, the width of the ids
    fingerprint: int  # `batch_fingerprint` of the batch, in `[0, 2**62)`


def validate_batch(batch: Any, spec: BatchSpec) -> NonFinite | None:
    """Check `batch` against `spec` on the host; returns the first non-finite float entry
    (batch key order, then row-major) or `None`.

    Raises:
        TypeError: not a mapping; a required value not a tensor; ids, lengths or masks of the
            wrong dtype (bool is not an id).
        ValueError: an empty batch, a missing key, mismatched sample counts or widths,
            `input_lengths` outside `[1, S]`, bad masks, a `token_mask` beyond `input_lengths`,
            ids outside `[0, V)`, `S` above `spec.max_positions`.
    """
    # it reads only the batch and the model's vocabulary/position sizes: every rank holding the
    # same data reaches the same verdict without communicating
    if not isinstance(batch, Mapping):
        raise TypeError(
            f"A batch must be a mapping of tensors (a dict or BatchedDataDict), got "
            f"{type(batch).__name__}."
        )
    if len(batch) == 0:
        raise ValueError("The batch is empty (no keys); the DataLoader yielded an empty mapping.")
    ids_key = "tokens" if spec.lm else "input_ids"
    required: tuple[str, ...] = LM_KEYS if spec.lm else ("input_ids", "sample_mask")
    if spec.needs_lengths and not spec.lm:
        required = (*required, "input_lengths")
    for key in required:
        _check_present(batch, key, None)
    for key in spec.required:
        _check_present(batch, key, spec.required_by)
    ids = batch[ids_key]
    _check_ids(ids_key, ids, spec.vocab_size)
    size, width = ids.shape
    if size == 0:
        raise ValueError(
            f"The batch is empty: `{ids_key}` has 0 samples (shape {list(ids.shape)})."
        )
    if width == 0:
        raise ValueError(f"`{ids_key}` has width 0 (shape {list(ids.shape)}); S must be >= 1.")
    if spec.max_positions is not None and width > spec.max_positions:
        raise ValueError(
            f"`{ids_key}` has S={width} positions (shape {list(ids.shape)}) but the model's "
            f"learned position table holds max_sequence_length={spec.max_positions}; truncate "
            "the rows or build the model with a larger `max_sequence_length`."
        )
    for key, value in batch.items():
        if isinstance(value, Tensor) and (value.dim() == 0 or value.shape[0] != size):
            raise ValueError(
                f"`{key}` has {_samples(value)} samples but `{ids_key}` has {size}: every tensor "
                "of a batch holds one entry per sample along dim 0."
            )
    if spec.lm:
        _check_ids("labels", batch["labels"], spec.vocab_size, shape=(size, width))
    else:
        _check_loss_batch(batch, size, width, spec.vocab_size)
    return first_nonfinite(batch)


def _check_present(batch: Mapping[str, Any], key: str, required_by: str | None) -> None:
    if key not in batch:
        reader = "" if required_by is None else f" that {required_by} reads (its `input_keys`)"
        raise ValueError(
            f"The batch is missing the key `{key}`{reader} (present: {sorted(batch)})."
        )
    if not isinstance(batch[key], Tensor):
        raise TypeError(f"`{key}` must be a torch.Tensor, got {type(batch[key]).__name__}.")


def _samples(value: Tensor) -> str:
    return "no" if value.dim() == 0 else str(value.shape[0])


def _check_ids(
    key: str, ids: Any, vocab_size: int | None, shape: tuple[int, ...] | None = None
) -> None:
    if not isinstance(ids, Tensor):
        raise TypeError(f"`{key}` must be a torch.Tensor, got {type(ids).__name__}.")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise TypeError(f"`{key}` must hold integer token ids, got dtype {ids.dtype}.")
    if shape is not None and tuple(ids.shape) != shape:
        raise ValueError(f"`{key}` must have shape {list(shape)}, got {list(ids.shape)}.")
    if shape is None and ids.dim() != 2:
        raise ValueError(f"`{key}` must be [B, S], got shape {list(ids.shape)}.")
    if ids.numel() == 0:
        return
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or (vocab_size is not None and high >= vocab_size):
        bad = (ids < 0) if low < 0 else (ids >= int(vocab_size or 0))
        where = [int(i) for i in bad.nonzero()[0]]
        value = int(ids[tuple(where)])
        bound = "V" if vocab_size is None else f"V={vocab_size}"
        raise ValueError(
            f"`{key}` holds id {value} at {where}, outside the vocabulary [0, {bound}) of the "
            "model."
        )


def _check_loss_batch(
    batch: Mapping[str, Any], size: int, width: int, vocab_size: int | None
) -> None:
    lengths = batch.get("input_lengths")
    if lengths is not None:
        if not isinstance(lengths, Tensor):
            raise TypeError(
                f"`input_lengths` must be a torch.Tensor, got {type(lengths).__name__}."
            )
        if lengths.dtype == torch.bool or lengths.is_floating_point():
            raise TypeError(f"`input_lengths` must be an integer tensor, got {lengths.dtype}.")
        if tuple(lengths.shape) != (size,):
            raise ValueError(f"`input_lengths` must be [B]=[{size}], got {list(lengths.shape)}.")
        bad = (lengths < 1) | (lengths > width)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"`input_lengths`[{row}] = {int(lengths[row])} is outside [1, S={width}] "
                "(S = the width of `input_ids`)."
            )
    for key, shape in (("sample_mask", (size,)), ("token_mask", (size, width))):
        mask = batch.get(key)
        if mask is None:
            continue
        if not isinstance(mask, Tensor):
            raise TypeError(f"`{key}` must be a torch.Tensor, got {type(mask).__name__}.")
        if mask.is_complex():
            raise TypeError(f"`{key}` must be a bool, integer or float mask, got {mask.dtype}.")
        if tuple(mask.shape) != shape:
            raise ValueError(f"`{key}` must have shape {list(shape)}, got {list(mask.shape)}.")
        values = mask.float()
        off = ~((values == 0) | (values == 1))
        if bool(off.any()):
            where = [int(i) for i in off.nonzero()[0]]
            raise ValueError(
                f"`{key}` must hold 0/1 values, got {float(values[tuple(where)])} at {where}."
            )
    token_mask = batch.get("token_mask")
    if isinstance(lengths, Tensor) and isinstance(token_mask, Tensor):
        beyond = torch.arange(width)[None, :] >= lengths.cpu()[:, None]
        stray = beyond & (token_mask.cpu().float() != 0)
        if bool(stray.any()):
            row, col = (int(i) for i in stray.nonzero()[0])
            raise ValueError(
                f"`token_mask`[{row}, {col}] is set but `input_lengths`[{row}] = "
                f"{int(lengths[row])}: the mask does not match the lengths."
            )
    for key in PER_TOKEN_KEYS:
        value = batch.get(key)
        if value is None:
            continue
        if not isinstance(value, Tensor):
            raise TypeError(f"`{key}` must be a torch.Tensor, got {type(value).__name__}.")
        if tuple(value.shape) != (size, width):
            raise ValueError(
                f"`{key}` must have shape [B, S]={[size, width]} like `input_ids`, got "
                f"{list(value.shape)}."
            )
    indices = batch.get("teacher_topk_indices")
    if isinstance(indices, Tensor):
        if indices.dim() != 3 or tuple(indices.shape[:2]) != (size, width):
            raise ValueError(
                f"`teacher_topk_indices` must be [B, S, K] with [B, S]={[size, width]}, got "
                f"{list(indices.shape)}."
            )
        _check_ids("teacher_topk_indices", indices.flatten(1), vocab_size)


def first_nonfinite(batch: Mapping[str, Any]) -> NonFinite | None:
    """The first NaN/±inf entry of the batch's floating-point tensors (``None`` if all finite)."""
    for key, value in batch.items():
        if not isinstance(value, Tensor) or not value.is_floating_point() or value.numel() == 0:
            continue
        bad = ~torch.isfinite(value)
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            return NonFinite(key=str(key), position=where, value=float(value[where]))
    return None


def loss_input_keys(loss_fn: object) -> tuple[str, ...]:
    """The batch keys `loss_fn` reads beyond `input_ids` and `sample_mask` (its `input_keys`).

    Raises:
        TypeError: `input_keys` is not a sequence of key names.
    """
    # checked up front instead of inside the loss, after the step's first collectives; a loss
    # without `input_keys` declares none: only the data contract's keys are checked
    declared = getattr(loss_fn, "input_keys", ())
    if (
        isinstance(declared, str)
        or not isinstance(declared, Sequence)
        or not all(isinstance(key, str) for key in declared)
    ):
        raise TypeError(
            f"`{type(loss_fn).__name__}.input_keys` must be a tuple of batch key names (str), "
            f'got {declared!r}; declare e.g. `input_keys = ("token_mask",)`.'
        )
    return tuple(declared)


_FINGERPRINT_BITS = (1 << 62) - 1
_FINGERPRINT_MIX = 1_000_003


def batch_fingerprint(batch: Mapping[str, Any]) -> int:
    """A cheap content hash of a batch, equal on ranks holding equal data: an int in
    `[0, 2**62)`."""
    # Per `[B]` or `[B, S]` tensor (keys sorted) the int64 sum of its elements (ids as they are,
    # floats by their bit patterns) times their 1-based flat positions (so moved rows change
    # it), mixed over the keys. Wider per-token payloads (`[B, S, K]`, `[B, S, D]`) are left
    # out: their `[B, S]` neighbours differ when the rows differ.
    tensors = [
        batch[key].detach().reshape(-1)
        for key in sorted(batch)
        if isinstance(batch[key], Tensor) and 0 < batch[key].dim() <= 2 and batch[key].numel()
    ]
    if not tensors:
        return 0
    size = max(t.numel() for t in tensors)
    weights = torch.arange(1, size + 1, dtype=torch.int64, device=tensors[0].device)
    total = 0
    for flat in tensors:
        if flat.is_floating_point():
            flat = flat.float().view(torch.int32)  # the bit pattern: NaN and -0.0 included
        # int64 products and sum wrap modulo 2**64: deterministic on every rank
        part = int((flat.to(torch.int64) * weights[: flat.numel()]).sum())
        total = (total * _FINGERPRINT_MIX + part) & _FINGERPRINT_BITS
    return total


def batch_summary(batch: Mapping[str, Any], spec: BatchSpec) -> BatchSummary:
    """Rows, width and fingerprint of a batch that passed `validate_batch`."""
    ids = batch["tokens" if spec.lm else "input_ids"]
    rows, width = ids.shape
    return BatchSummary(rows=int(rows), width=int(width), fingerprint=batch_fingerprint(batch))


def _model_attribute(chunks: Sequence[torch.nn.Module], name: str) -> Any:
    """Attribute ``name`` of the first chunk that has it, unwrapped through megatron's
    DDP/``Float16Module`` ``.module`` (``None`` when no chunk exposes it)."""
    for chunk in chunks:
        module: Any = chunk
        for _ in range(8):
            value = getattr(module, name, None)
            if value is not None:
                return value
            module = getattr(module, "module", None)
            if module is None:
                break
    return None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def model_vocab_size(chunks: Sequence[torch.nn.Module]) -> int | None:
    """``V`` of the model: the ``vocab_size`` of the first chunk (unwrapped through megatron's
    DDP/``Float16Module`` ``.module``), ``None`` when the model does not expose one."""
    return _int_or_none(_model_attribute(chunks, "vocab_size"))


def model_position_limit(chunks: Sequence[torch.nn.Module]) -> int | None:
    """The rows of the model's learned position table (`None` for rotary or other positions)."""
    # a megatron `GPTModel` with `position_embedding_type="learned_absolute"` has
    # `max_sequence_length` of them on every pipeline stage, so every rank reaches the same
    # verdict; other positions have no table to index past
    if _model_attribute(chunks, "position_embedding_type") != "learned_absolute":
        return None
    return _int_or_none(_model_attribute(chunks, "max_sequence_length"))


__all__ = [
    "BatchSpec",
    "BatchSummary",
    "NonFinite",
    "batch_fingerprint",
    "batch_summary",
    "first_nonfinite",
    "loss_input_keys",
    "model_position_limit",
    "model_vocab_size",
    "validate_batch",
]
