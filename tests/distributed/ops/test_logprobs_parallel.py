"""Multi-rank parity of the logprob kernels against single-rank fp32 plain-torch references.

Every layout TP in {1, 2} x CP in {1, 2} runs on real gloo groups; each spawned run performs all
checks and returns ``{check: max_abs_diff}`` so the asserts (and their tolerances) live here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from ops_rank_helpers import (
    build_groups,
    max_diff,
    ref_next_token_logprobs,
    ref_top_k_top_p,
    shard,
    shard_packed,
)

from lightning_mcore_rl.ops import (
    TrainingSamplingParams,
    allgather_cp_sharded_tensor,
    from_parallel_logits_to_logprobs,
    from_parallel_logits_to_logprobs_packed_sequences,
    get_tokens_on_this_cp_rank,
    packed_local_targets,
    vocab_parallel_entropy,
)
from lightning_mcore_rl.testing import run_on_ranks

B, S, S_PAD, V = 2, 14, 16, 64  # S tokens padded to S_PAD (divisible by 2*CP for CP <= 4)
# bf16 logits: values are computed in fp32 from the bf16 inputs (reference uses the same
# quantised inputs); gradients come back in bf16: half-ulp 2^-9 x |grad| <= ~3 (randn weights).
TOL = {"float32": (1e-5, 1e-5), "bfloat16": (1e-5, 1e-2)}  # (values, grads); see above


def _dense_case(tp: int, cp: int, dtype: torch.dtype, scale: float, groups: tuple) -> dict:
    tp_group, cp_group, tp_rank, cp_rank = groups
    gen = torch.Generator().manual_seed(42)
    full = (torch.randn(B, S_PAD, V, generator=gen) * scale).to(dtype).float()
    ids = torch.randint(0, V, (B, S), generator=gen)
    ids[0, 1:5] = torch.tensor([0, V // 2 - 1, V // 2, V - 1])  # shard boundaries, vocab ends
    weights = torch.randn(B, S - 1, generator=gen)
    ref_leaf = full.clone().requires_grad_()
    ref = ref_next_token_logprobs(ref_leaf[:, :S], ids)
    (ref * weights).sum().backward()
    local_vocab = V // tp
    span = (tp_rank * local_vocab, (tp_rank + 1) * local_vocab)
    out: dict[str, float] = {}
    grads = {}
    for chunk in (None, 3):
        leaf = shard(full, tp_rank, tp, cp_rank, cp).to(dtype).requires_grad_()
        lp = from_parallel_logits_to_logprobs(
            leaf, ids, *span, tp_group, cp_group=cp_group, chunk_size=chunk
        )
        # every CP rank computes the full loss; the CP gather backward sums them -> divide by CP
        ((lp * weights).sum() / cp).backward()
        out[f"value chunk={chunk}"] = max_diff(lp, ref) / max(1.0, scale)
        grads[chunk] = leaf.grad
        out[f"grad chunk={chunk}"] = max_diff(
            leaf.grad, shard(ref_leaf.grad, tp_rank, tp, cp_rank, cp)
        )
        out[f"finite chunk={chunk}"] = 0.0 if torch.isfinite(lp).all() else 1.0
    out["grad chunked==plain"] = max_diff(grads[None], grads[3])
    with torch.no_grad():
        leaf = shard(full, tp_rank, tp, cp_rank, cp).to(dtype)
        lp = from_parallel_logits_to_logprobs(leaf, ids, *span, tp_group, True, cp_group, 4)
        out["inference_only"] = max_diff(lp, ref) / max(1.0, scale)
    return out


def _sampling_case(tp: int, cp: int, dtype: torch.dtype, groups: tuple) -> dict:
    tp_group, cp_group, tp_rank, cp_rank = groups
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(B, S_PAD, V, generator=gen).to(dtype).float()
    # mostly targets among the top-3 so most positions survive the filter
    top3 = full[:, :S].topk(3, dim=-1).indices
    pick = top3.gather(-1, torch.randint(0, 3, (B, S, 1), generator=gen)).squeeze(-1)
    ids = torch.where(torch.rand(B, S, generator=gen) < 0.8, pick, torch.randint(0, V, (B, S)))
    weights = torch.randn(B, S - 1, generator=gen)
    out: dict[str, float] = {}
    for params in (TrainingSamplingParams(top_k=5), TrainingSamplingParams(top_k=8, top_p=0.7)):
        ref_leaf = full.clone().requires_grad_()
        filtered = ref_top_k_top_p(ref_leaf[:, : S - 1], params.top_k, params.top_p)
        ref = F.log_softmax(filtered, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        torch.where(torch.isfinite(ref), ref * weights, 0.0).sum().backward()
        for chunk in (None, 4):
            leaf = shard(full, tp_rank, tp, cp_rank, cp).to(dtype).requires_grad_()
            span = (tp_rank * V // tp, (tp_rank + 1) * V // tp)
            lp = from_parallel_logits_to_logprobs(
                leaf, ids, *span, tp_group, cp_group=cp_group, chunk_size=chunk,
                sampling_params=params,
            )  # fmt: skip
            (torch.where(torch.isfinite(lp), lp * weights, 0.0).sum() / cp).backward()
            key = f"top_k={params.top_k} top_p={params.top_p} chunk={chunk}"
            same_inf = torch.equal(torch.isinf(lp), torch.isinf(ref))
            finite = torch.isfinite(ref)
            out[f"value {key}"] = max_diff(lp[finite], ref[finite]) if same_inf else 1.0
            expected = shard(ref_leaf.grad, tp_rank, tp, cp_rank, cp)
            out[f"grad {key}"] = max_diff(leaf.grad, expected)
    return out


LENGTHS = [6, 11, 3, 9]


def _packed_case(tp: int, cp: int, dtype: torch.dtype, groups: tuple) -> dict:
    tp_group, cp_group, tp_rank, cp_rank = groups
    gen = torch.Generator().manual_seed(3)
    multiple = 2 * cp
    padded = [-(-n // multiple) * multiple for n in LENGTHS]
    cu = [0]
    for p in padded:
        cu.append(cu[-1] + p)
    total = cu[-1]
    packed = torch.randn(1, total, V, generator=gen).to(dtype).float()
    ids = torch.randint(0, V, (1, total), generator=gen)
    width = max(LENGTHS) + 1  # unpacked S
    weights = torch.randn(len(LENGTHS), width - 1, generator=gen)
    valid = torch.zeros(len(LENGTHS), width - 1)
    for i, n in enumerate(LENGTHS):
        valid[i, : n - 1] = 1.0
    # reference: every sequence on its own real tokens
    ref_leaf = packed.clone().requires_grad_()
    ref = torch.zeros(len(LENGTHS), width - 1)
    for i, n in enumerate(LENGTHS):
        a = cu[i]
        ref[i, : n - 1] = ref_next_token_logprobs(ref_leaf[:, a : a + n], ids[:, a : a + n])[0]
    (ref * weights * valid).sum().backward()
    # the same sequences unpacked into a dense [B, S_dense] batch
    dense_len = -(-width // multiple) * multiple
    dense_logits = torch.zeros(len(LENGTHS), dense_len, V)
    dense_ids = torch.zeros(len(LENGTHS), width, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        dense_logits[i, :n] = packed[0, cu[i] : cu[i] + n]
        dense_ids[i, :n] = ids[0, cu[i] : cu[i] + n]
    span = (tp_rank * V // tp, (tp_rank + 1) * V // tp)
    dense = from_parallel_logits_to_logprobs(
        shard(dense_logits, tp_rank, tp, cp_rank, cp).to(dtype), dense_ids, *span, tp_group,
        inference_only=True, cp_group=cp_group,
    )  # fmt: skip
    out: dict[str, float] = {}
    results = {}
    for chunk in (None, 3):
        for pre_rolled in (False, True):
            leaf = shard_packed(packed, cu, tp_rank, tp, cp_rank, cp).to(dtype).requires_grad_()
            target = (
                packed_local_targets(ids, cu, leaf.shape[1], cp_rank, cp) if pre_rolled else ids
            )
            lp = from_parallel_logits_to_logprobs_packed_sequences(
                leaf, target, torch.tensor(cu), width, *span, tp_group, cp_group=cp_group,
                chunk_size=chunk, target_is_pre_rolled=pre_rolled,
            )  # fmt: skip
            ((lp * weights * valid).sum() / cp).backward()
            key = f"chunk={chunk} pre_rolled={pre_rolled}"
            out[f"packed value {key}"] = max_diff(lp * valid, ref)
            out[f"packed==unpacked {key}"] = max_diff(lp * valid, dense * valid)
            expected = shard_packed(ref_leaf.grad, cu, tp_rank, tp, cp_rank, cp)
            out[f"packed grad {key}"] = max_diff(leaf.grad, expected)
            results[key] = lp
    out["packed chunked==plain"] = max_diff(
        results["chunk=None pre_rolled=False"], results["chunk=3 pre_rolled=True"]
    )
    return out


def _cp_gather_and_entropy(tp: int, cp: int, dtype: torch.dtype, groups: tuple) -> dict:
    tp_group, cp_group, tp_rank, cp_rank = groups
    gen = torch.Generator().manual_seed(11)
    out: dict[str, float] = {}
    for seq_dim, shape in ((1, (2, 8, 3)), (0, (8, 3))):
        full = torch.randn(*shape, generator=gen)
        local = get_tokens_on_this_cp_rank(full, cp_rank, cp, seq_dim).clone().requires_grad_()
        gathered = allgather_cp_sharded_tensor(local, cp_group, seq_dim=seq_dim)
        gathered.pow(2).sum().backward()
        out[f"cp roundtrip seq_dim={seq_dim}"] = max_diff(gathered, full)
        out[f"cp grad seq_dim={seq_dim}"] = max_diff(local.grad, cp * 2 * local.detach())
    logits = (torch.randn(B, 6, V, generator=gen) * 3).to(dtype).float()
    weights = torch.randn(B, 6, generator=gen)
    ref_leaf = logits.clone().requires_grad_()
    logp = F.log_softmax(ref_leaf, -1)
    ref = -(logp.exp() * logp).sum(-1)
    (ref * weights).sum().backward()
    local_vocab = V // tp
    cols = slice(tp_rank * local_vocab, (tp_rank + 1) * local_vocab)
    for chunk in (None, 4):
        leaf = logits[..., cols].to(dtype).requires_grad_()
        entropy = vocab_parallel_entropy(leaf, tp_group, chunk_size=chunk)
        (entropy * weights).sum().backward()
        out[f"entropy value chunk={chunk}"] = max_diff(entropy, ref)
        out[f"entropy grad chunk={chunk}"] = max_diff(leaf.grad, ref_leaf.grad[..., cols])
    return out


def _all_checks(rank: int, tp: int, cp: int) -> dict:
    groups = build_groups(tp, cp)
    results: dict[str, dict[str, float]] = {}
    for name in ("float32", "bfloat16"):
        dtype = getattr(torch, name)
        res = _dense_case(tp, cp, dtype, 1.0, groups)
        res.update({f"x100 {k}": v for k, v in _dense_case(tp, cp, dtype, 100.0, groups).items()})
        res.update(_sampling_case(tp, cp, dtype, groups))
        res.update(_packed_case(tp, cp, dtype, groups))
        res.update(_cp_gather_and_entropy(tp, cp, dtype, groups))
        results[name] = res
    return results


@pytest.mark.parametrize(("tp", "cp"), [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_logprob_kernels_match_reference(tp: int, cp: int) -> None:
    per_rank = run_on_ranks(_all_checks, tp * cp, tp, cp, emulate_cuda=False, timeout=100)
    failures = []
    for rank, results in enumerate(per_rank):
        for dtype_name, checks in results.items():
            value_tol, grad_tol = TOL[dtype_name]
            for check, diff in checks.items():
                tol = grad_tol if "grad" in check else value_tol
                if "x100" in check and "grad" in check:
                    tol = max(tol, 1e-4)  # relative-size rounding of softmax at |z| ~ 300
                if not diff <= tol:
                    failures.append(f"rank {rank} {dtype_name} {check}: {diff:.3g} > {tol:g}")
    assert not failures, "\n".join(failures)
