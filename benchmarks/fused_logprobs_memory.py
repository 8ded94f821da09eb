"""Peak memory and time of one training step of a GPT-like last stage: fused linear logprobs vs
logits through our post-processor vs megatron's LM cross entropy.

The last stage is a megatron ``GPTModel`` chunk: one transformer layer (packed local spec), the
final norm and an untied ``[V, H]`` output layer, bf16 in megatron's ``Float16Module`` as the
strategy runs it under ``bf16-mixed`` (so the logits paths get fp32 logits). The first stage's embedding is frozen (it
belongs to another pipeline stage, so it gets no gradient here). The input is one packed THD row of
``tokens`` tokens (documents of ``--doc-len``), next-token targets, one forward+backward each:

* ``megatron_ce``: megatron's LM path, ``GPTModel(..., labels=)`` ->
  ``compute_language_model_loss`` (``vocab_parallel_cross_entropy`` on the bf16 logits), masked
  token mean.
* ``plain``: logits through ``forward_with_post_processing_fn`` + ``LossPostProcessor(NLLLossFn)``
  at the strategy's default ``logprob_chunk_size=None``.
* ``plain_chunked``: the same with ``logprob_chunk_size=--chunk``, at the strategy's default
  ``defer_fp32_logits=None``, which defers here (``train.logits_dtype.defers_fp32_logits``): the
  logits stay bf16 (``Float16Module(fp32_output=False)``) and the kernel upcasts per chunk.
* ``plain_chunked_one_pass``: ``plain_chunked`` with ``PolicyConfig(fuse_loss=True)``: one
  kernel call over the whole packed row (``prepare_packed_loss_input``) instead of one per
  sequence on a ``narrow`` of the logits (``SequencePackingLossWrapper``, the packed default,
  whose backward gives every sequence a zero-filled full-size logits gradient to accumulate).
* ``plain_chunked_fp32``: ``plain_chunked`` with ``defer_fp32_logits=False``: ``Float16Module``
  upcasts the whole output to fp32 logits (the strategy's path before the deferral).
* ``fused``: ``use_fused_linear_logprobs=True`` (the output layer bypassed, logprobs from hidden x
  weight in 64 MiB fp32 blocks, one kernel call over the packed row); its backward recomputes the
  blocks.
* ``fused_in_forward``: ``fused`` with ``fused_gradient_in_forward=True``: ``NLLLossFn`` being
  token-local, the head's gradients are computed in the forward (``docs/training-step.md``, "The
  gradient in the forward"): nothing is recomputed.

All seven compute the same loss (the mean next-token NLL); it is printed as a check. Each variant
runs in its own fresh gloo rank (``run_on_ranks``), one at a time. Memory: glibc's mmap threshold
is pinned at 64 KiB (freed tensors leave RSS); ``VmHWM`` is reset through ``/proc/self/clear_refs``
once the model and the batch are built, and "peak extra" is the peak RSS of the step minus the
RSS just before it (the parameter gradients the step creates are included).

With ``--device cuda`` the rank runs on the GPU (no CPU emulation) and "peak extra" is
``torch.cuda.max_memory_allocated`` during the step minus ``memory_allocated`` before it.

Run: ``.venv/bin/python benchmarks/fused_logprobs_memory.py [--tokens 8192 --vocab 131072]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # read by the ranks' glibc at start

import torch  # noqa: E402

from lightning_mcore_rl.testing import run_on_ranks  # noqa: E402

MiB = 2**20
VARIANTS = (
    "megatron_ce",
    "plain",
    "plain_chunked",
    "plain_chunked_one_pass",
    "plain_chunked_fp32",
    "fused",
    "fused_in_forward",
)


def _status_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def _step_rank(rank: int, variant: str, cfg: dict) -> dict[str, float]:
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.module import Float16Module

    from lightning_mcore_rl.data import BatchedDataDict
    from lightning_mcore_rl.losses import NLLLossFn
    from lightning_mcore_rl.losses.loss_input import _pack_input_ids
    from lightning_mcore_rl.models.layers import get_packed_local_layer_spec
    from lightning_mcore_rl.parallel import megatron_groups
    from lightning_mcore_rl.testing import init_megatron_state, tiny_gpt, tiny_gpt_config
    from lightning_mcore_rl.train import (
        LossPostProcessor,
        PolicyConfig,
        forward_with_post_processing_fn,
        process_global_batch,
    )
    from lightning_mcore_rl.train.logits_dtype import defers_fp32_logits

    init_megatron_state()
    config = tiny_gpt_config(
        num_layers=1, hidden_size=cfg["hidden"], num_attention_heads=16, bf16=True,
        calculate_per_token_loss=True,
    )  # fmt: skip
    model = tiny_gpt(
        config, vocab_size=cfg["vocab"], max_sequence_length=cfg["doc_len"],
        transformer_layer_spec=get_packed_local_layer_spec(),
    )  # fmt: skip
    model.embedding.requires_grad_(False)  # the first stage's: no gradient on the last stage
    model = Float16Module(config, model)  # as the strategy wraps bf16 chunks (fp32 last output)
    cuda = cfg["device"] == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    model.to(device)
    docs = cfg["tokens"] // cfg["doc_len"]
    ids = torch.randint(0, cfg["vocab"], (docs, cfg["doc_len"]), generator=torch.Generator())
    ids = ids.to(device)
    token_mask = torch.ones(docs, cfg["doc_len"], device=device)
    token_mask[:, 0] = 0  # the first token is not predicted
    data = BatchedDataDict(
        input_ids=ids, input_lengths=torch.full((docs,), cfg["doc_len"]),
        token_mask=token_mask, sample_mask=torch.ones(docs, device=device),
    )  # fmt: skip
    batch = process_global_batch(data, ps.get_data_parallel_group(), docs, sequence_packing=True)
    mb = batch.microbatches[0]
    fused = variant.startswith("fused")
    chunk = cfg["chunk"] if variant.startswith("plain_chunked") else None
    policy = PolicyConfig(
        sequence_packing=True,
        fuse_loss=variant == "plain_chunked_one_pass",
        logprob_chunk_size=chunk,
        fused_gradient_in_forward=variant == "fused_in_forward",
    )
    post = LossPostProcessor(NLLLossFn(), policy, 1, use_fused_linear_logprobs=fused)
    setting = False if variant == "plain_chunked_fp32" else None  # None: the strategy default
    defer = defers_fp32_logits(setting, post, None)  # as the step resolves it
    cu_q, cu_qp = mb.packed_seq_params.cu_seqlens_q, mb.packed_seq_params.cu_seqlens_q_padded
    labels = _pack_input_ids(ids, cu_q, cu_qp, roll_shift=-1)  # [1, T] next tokens per span
    loss_mask = _pack_input_ids(token_mask, cu_q, cu_qp, roll_shift=-1)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated() / MiB
    else:
        baseline = _status_mib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    start = time.perf_counter()
    logits_dtype = "bfloat16"  # megatron's LM path: the bf16 logits go into its cross entropy
    if variant == "megatron_ce":
        per_token = model(
            mb.input_ids_cp_sharded, mb.position_ids, None, labels=labels,
            packed_seq_params=mb.packed_seq_params,
        )  # fmt: skip  # [1, T] cross entropy
        loss = (per_token.float() * loss_mask).sum() / loss_mask.sum()
    else:
        output, fn = forward_with_post_processing_fn(
            iter([mb]), model, post, global_valid_seqs=batch.global_valid_seqs,
            global_valid_toks=batch.global_valid_toks, use_fused_linear_logprobs=fused,
            defer_fp32_logits=defer, groups=megatron_groups(),
        )  # fmt: skip
        logits_dtype = str(output.dtype).removeprefix("torch.")
        loss = fn(output)[0]
        del output  # megatron's schedule rebinds it to the loss: only autograd keeps the logits
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / MiB if cuda else _status_mib("VmHWM")
    return {
        "peak_extra_mib": peak - baseline,
        "seconds": seconds,
        "loss": float(loss.detach()),
        "defer_fp32_logits": defer,
        "output_dtype": logits_dtype,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--doc-len", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=1024, help="plain_chunked logprob_chunk_size")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    keys = ("tokens", "vocab", "hidden", "doc_len", "chunk", "device")
    cfg = {k: getattr(args, k) for k in keys}
    logits_mib = args.tokens * args.vocab * 2 / MiB
    print(
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{args.device}; tokens="
        f"{args.tokens}, vocab={args.vocab}, hidden={args.hidden}, bf16 logits "
        f"[{args.tokens}, {args.vocab}] = {logits_mib:.0f} MiB"
    )
    rows = {}
    for variant in args.variants:
        (rows[variant],) = run_on_ranks(
            _step_rank, 1, variant, cfg, timeout=1800, emulate_cuda=args.device == "cpu"
        )
        print(variant, rows[variant], flush=True)
    ref = rows.get("megatron_ce")
    print(
        "\n| variant | last-stage output | fwd+bwd s | peak extra MiB | vs megatron CE "
        "| / bf16 logits | loss |"
    )
    print("|---|---|---|---|---|---|---|")
    for variant, r in rows.items():
        ratio = f"{r['peak_extra_mib'] / ref['peak_extra_mib']:.3f}x" if ref else "-"
        print(
            f"| {variant} | {r['output_dtype']} | {r['seconds']:.2f} | "
            f"{r['peak_extra_mib']:.0f} | {ratio} | {r['peak_extra_mib'] / logits_mib:.3f}x | "
            f"{r['loss']:.6f} |"
        )


if __name__ == "__main__":
    main()
