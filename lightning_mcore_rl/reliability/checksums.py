"""Checksums of checkpoint files (`MANIFEST`: each file's size and CRC-32, written at save,
verified before a load, each rank hashing a share) and messages naming the damaged file: the
same `CorruptCheckpointError` on every rank."""

# CRC-32 (`zlib.crc32`), not a cryptographic hash: the checks are against accidental damage (bit
# flips, truncated or overwritten files), not an adversary; it detects every single-bit flip and
# every burst of up to 32 bits, misses other random damage with probability 2**-32, and costs
# about a third of blake2b (docs/reliability.md). A checkpoint saved before checksums loads
# unverified, with a warning; if megatron then fails to read it, `damaged_files` names the file.

from __future__ import annotations

import json
import os
import warnings
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

MANIFEST = "checksums.json"
"""Name of the manifest in a checkpoint directory: ``{"algorithm": "crc32", "files": {relative
path: {"bytes": size, "crc32": "0x%08x"}}}``."""

_BLOCK = 8 * 2**20


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, changed or unreadable; raised on every rank."""


def file_crc32(path: Path) -> str:
    """CRC-32 of the file at ``path`` as ``"0x%08x"``, read in 8 MiB blocks."""
    crc, buffer = 0, bytearray(_BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as stream:
        while n := stream.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
    return f"0x{crc:08x}"


def shares(sizes: Mapping[str, int], world_size: int) -> list[list[str]]:
    """Files per rank for hashing: largest first, each to the rank with the fewest bytes so far
    (ties: lowest rank)."""
    # deterministic in `sizes`: every rank computes the same split without a collective
    loads = [0] * world_size
    split: list[list[str]] = [[] for _ in range(world_size)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        rank = loads.index(min(loads))
        split[rank].append(name)
        loads[rank] += sizes[name]
    return split


def _rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_gather(obj: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _listing(directory: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``directory`` except the manifest."""
    return {
        str(p.relative_to(directory)): p.stat().st_size
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }


def write_manifest(directory: Path) -> None:
    """Collective, after every rank's `dist_checkpointing.save` into `directory`: each rank
    hashes its `shares` of the files and rank 0 writes `MANIFEST`."""
    rank, world = _rank_and_world()
    # rank 0 lists the files: megatron's rank 0 finishes its save last, after every rank's shards
    listing = [_listing(directory) if rank == 0 else None]
    if world > 1:
        dist.broadcast_object_list(listing, src=0)
    sizes: dict[str, int] = listing[0] or {}
    mine = {name: file_crc32(directory / name) for name in shares(sizes, world)[rank]}
    digests = {name: crc for part in _all_gather(mine) for name, crc in part.items()}
    if rank != 0:
        return
    files = {name: {"bytes": sizes[name], "crc32": digests[name]} for name in sorted(sizes)}
    partial = directory / f".{MANIFEST}.tmp"
    partial.write_text(json.dumps({"algorithm": "crc32", "files": files}, indent=1))
    os.replace(partial, directory / MANIFEST)


def _read_manifest(directory: Path) -> tuple[dict[str, dict[str, Any]] | None, list[str]]:
    """The manifest's ``files`` (None: no manifest) and the problems reading it."""
    path = directory / MANIFEST
    if not path.exists():
        return None, []
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if manifest["algorithm"] != "crc32" or not isinstance(files, dict):
            raise ValueError(f"algorithm {manifest['algorithm']!r}, files {type(files).__name__}")
        return {name: {"bytes": int(e["bytes"]), "crc32": str(e["crc32"])}
                for name, e in files.items()}, []  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return None, [f"{MANIFEST}: cannot be parsed ({type(err).__name__}: {err})"]


def _check_file(directory: Path, name: str, entry: Mapping[str, Any]) -> str | None:
    path = directory / name
    try:
        size = path.stat().st_size
        if size != entry["bytes"]:
            change = "truncated" if size < entry["bytes"] else "longer than saved"
            return f"{name}: {size} bytes, {MANIFEST} records {entry['bytes']} ({change})"
        crc = file_crc32(path)
    except FileNotFoundError:
        return f"{name}: missing ({MANIFEST} records {entry['bytes']} bytes)"
    except OSError as err:
        return f"{name}: cannot be read ({type(err).__name__}: {err})"
    if crc != entry["crc32"]:
        return (
            f"{name}: CRC-32 {crc} differs from the recorded {entry['crc32']} (same size: its "
            "content changed)"
        )
    return None


def verify(directory: Path) -> bool:
    """Collective, before megatron reads `directory`: each rank checks its `shares` of the files
    in `MANIFEST` (size, then CRC-32), one exchange of the findings; False: no manifest.

    Raises:
        CorruptCheckpointError: on every rank, naming each missing, truncated or changed file
            (or a damaged manifest).
    """
    rank, world = _rank_and_world()
    files, problems = _read_manifest(directory)
    if files is not None:
        mine = shares({name: e["bytes"] for name, e in files.items()}, world)[rank]
        problems = [p for name in mine if (p := _check_file(directory, name, files[name]))]
    found = _all_gather((files is not None, problems))
    everything = sorted({p for _, part in found for p in part})
    if everything:
        raise corrupt_error(directory, everything)
    if not all(has for has, _ in found):
        if rank == 0:
            warnings.warn(
                f"Checkpoint {directory} has no {MANIFEST} (saved before checksums): its files "
                "are loaded unverified.",
                stacklevel=2,
            )
        return False
    return True


def corrupt_error(directory: Path, problems: Sequence[str]) -> CorruptCheckpointError:
    """The error for damaged files of the checkpoint ``directory`` (one problem per file)."""
    return CorruptCheckpointError(
        f"Checkpoint {directory} is damaged and was not loaded: {'; '.join(problems)}. "
        "Resume from another checkpoint (e.g. an earlier `step=N.ckpt` of its directory)."
    )


def damaged_files(directory: Path) -> list[str]:
    """The files of a checkpoint without a manifest that cannot be read (this rank, no
    collective): `common.pt` not unpickling with `weights_only=True`, a `.metadata` that does not
    load, shard files missing or shorter than the byte ranges `.metadata` records."""
    # call under the caller's `safe_globals`: a type that is not allowed is no damage
    from torch.distributed.checkpoint import FileSystemReader

    problems: list[str] = []
    common = directory / "common.pt"
    try:
        torch.load(common, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        problems.append("common.pt: missing")
    except Exception as err:  # noqa: BLE001 - any failure to unpickle it is the finding
        if "Unsupported global" not in str(err):  # a type not allowed, not damage
            problems.append(f"common.pt: cannot be unpickled ({_unpickling_reason(err)})")
    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as err:  # noqa: BLE001
        return [*problems, f".metadata: cannot be read ({type(err).__name__}: {err})"]
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name in sorted(needed):
        path = directory / name
        if not path.is_file():
            problems.append(f"{name}: missing (.metadata records data in it)")
        elif (size := path.stat().st_size) < needed[name]:
            problems.append(
                f"{name}: {size} bytes, .metadata records data up to byte {needed[name]} "
                "(truncated)"
            )
    return problems


def _unpickling_reason(err: BaseException) -> str:
    """`err` in one line: torch's `WeightsUnpickler error` detail when present."""
    # without torch's advice to retry with `weights_only=False`: unsafe for a file that does not
    # unpickle (it runs arbitrary code)
    text = str(err)
    marker = "WeightsUnpickler error:"
    if marker in text:
        detail = text.split(marker, 1)[1].split("Check the documentation", 1)[0]
        text = " ".join(detail.split())
    if "weights_only" in text:
        text = "not a weights-only pickle"
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


__all__ = [
    "MANIFEST",
    "CorruptCheckpointError",
    "corrupt_error",
    "damaged_files",
    "file_crc32",
    "shares",
    "verify",
    "write_manifest",
]
