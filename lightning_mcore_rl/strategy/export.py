"""Convert an `MCoreRLStrategy` training checkpoint into a Hugging Face directory
(`lmrl export --ckpt DIR --hf-source HF_DIR --out OUT`)."""

# The model tensors of the `dist_checkpointing` directory carry global offsets, so whatever
# TP/PP/VPP layout it was saved under loads into one TP=1, PP=1 chunk built from the HF source's
# architecture, in this process alone (gloo world of 1, CPU emulation).

from __future__ import annotations

import argparse
import contextlib
import os
import socket
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from lightning_mcore_rl.models.hf.bridge import HFBridge, local_layer_spec
from lightning_mcore_rl.models.hf.safetensors_io import DEFAULT_MAX_SHARD_BYTES, existing_weights

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@contextlib.contextmanager
def _single_process_megatron() -> Iterator[None]:
    """A gloo world of 1 (unless one is already initialised) with megatron TP=PP=1 groups."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        raise RuntimeError(
            "export_checkpoint builds its own TP=1 PP=1 megatron state; call it in a process "
            "where megatron's parallel state is not initialised."
        )
    created = not dist.is_initialized()
    if created:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError(
            f"export_checkpoint runs in a single process; torch.distributed has world size "
            f"{dist.get_world_size()}."
        )
    try:
        ps.initialize_model_parallel()
        model_parallel_cuda_manual_seed(0)
        yield
    finally:
        ps.destroy_model_parallel()
        if created:
            dist.destroy_process_group()


def export_checkpoint(
    ckpt_dir: str | os.PathLike[str],
    hf_source: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    safe_types: Sequence[type] = (),
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write the model of training checkpoint `ckpt_dir` (any layout, `HFBridge.build_chunk`'s
    local spec) as an HF directory `out_dir` (returned), from `hf_source` (the run's start);
    `safe_types`: extra types `common.pt` may unpickle.

    Raises:
        FileExistsError: ``out_dir`` already holds weights (checked before loading).
        FileNotFoundError: ``ckpt_dir`` is not a checkpoint directory."""
    from lightning_mcore_rl.cpu import cpu_emulation
    from lightning_mcore_rl.strategy import checkpoint as ckpt

    bridge = HFBridge.from_pretrained(hf_source)
    message = existing_weights(Path(out_dir))
    if message is not None:
        raise FileExistsError(message)
    with cpu_emulation(), _single_process_megatron():
        config = bridge.transformer_config()
        spec = local_layer_spec(bridge.arch, config)
        chunk = bridge.build_chunk(config, transformer_layer_spec=spec)
        sharded = ckpt.sharded_model_state_dict([chunk])
        # megatron keys the local spec's norms like TE's fused ones, so checkpoints of either
        # spec load; their `_extra_state` entries differ by spec and hold no weights.
        template = {
            "state_dict": {k: v for k, v in sharded.items() if not k.endswith("._extra_state")}
        }
        loaded = ckpt.load(template, Path(ckpt_dir), safe_types)
        (state,) = ckpt.split_chunk_state_dict(loaded["state_dict"], 1)
        result = chunk.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("._extra_state")]
        if missing or result.unexpected_keys:
            raise ValueError(
                f"Checkpoint {ckpt_dir} does not fit the {bridge.arch.model_type} model of "
                f"{hf_source}: missing {missing[:8]}, unexpected {result.unexpected_keys[:8]}."
            )
        bridge.save_pretrained([chunk], out_dir, dtype=dtype, max_shard_bytes=max_shard_bytes)
    return Path(out_dir)


def main(argv: Sequence[str] | None = None) -> int:
    """``lmrl export``: parse ``argv`` and run `export_checkpoint`; returns 0."""
    parser = argparse.ArgumentParser(
        prog="lmrl export",
        description="Convert an MCoreRLStrategy checkpoint into a Hugging Face model directory.",
    )
    parser.add_argument("--ckpt", required=True, help="checkpoint directory written in training")
    parser.add_argument("--hf-source", required=True, help="HF directory the run started from")
    parser.add_argument("--out", required=True, help="new or empty output directory")
    parser.add_argument(
        "--dtype", choices=sorted(_DTYPES), default=None, help="default: the source's dtypes"
    )
    args = parser.parse_args(argv)
    dtype = _DTYPES[args.dtype] if args.dtype else None
    out = export_checkpoint(args.ckpt, args.hf_source, args.out, dtype=dtype)
    print(f"wrote {out}")
    return 0
