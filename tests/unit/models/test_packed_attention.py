"""Packed (THD, PackedDotProductAttention) vs padded (megatron's DotProductAttention) tiny GPT on
CPU: same per-token logprobs on real tokens and same gradients (fp32)."""

from __future__ import annotations

import pytest
import torch

from lightning_mcore_rl.testing import run_on_ranks

LENGTHS = [5, 12, 1, 9]
WIDTH = 12
VOCAB = 128


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    lengths = torch.tensor(LENGTHS)
    ids = torch.randint(1, VOCAB, (len(LENGTHS), WIDTH), generator=generator)
    ids[torch.arange(WIDTH)[None, :] >= lengths[:, None]] = 0
    return ids, lengths


def _next_token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[b, s, V]`` logits, ``[b, s]`` ids -> ``[b, s-1]`` log p(x_{t+1} | x_<=t)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, ids[:, 1:, None])[..., 0]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def _packed_vs_padded(
    rank: int, position_embedding_type: str, pad_individual: int, num_query_groups: int
) -> dict[str, object]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from lightning_mcore_rl.data import pack_sequences, packed_position_ids, unpack_sequences
    from lightning_mcore_rl.models.layers import get_packed_local_layer_spec
    from lightning_mcore_rl.testing import init_megatron_state, tiny_gpt, tiny_gpt_config

    init_megatron_state()
    ids, lengths = _batch()
    weights = torch.linspace(0.5, 1.5, WIDTH - 1)  # arbitrary per-position loss weights
    real = (torch.arange(1, WIDTH)[None, :] < lengths[:, None]).float()  # [B, S-1] real targets
    kwargs = {
        "config": tiny_gpt_config(num_query_groups=num_query_groups),
        "max_sequence_length": 64,
        "position_embedding_type": position_embedding_type,
    }

    padded_model = tiny_gpt(transformer_layer_spec=get_gpt_layer_local_spec(), **kwargs)
    position_ids = torch.arange(WIDTH)[None, :].expand(len(LENGTHS), -1)
    padded_logits = padded_model(ids, position_ids, None)  # [B, S, V]
    padded_lp = _next_token_logprobs(padded_logits, ids)
    (padded_lp * real * weights).sum().backward()

    packed_model = tiny_gpt(transformer_layer_spec=get_packed_local_layer_spec(), **kwargs)
    packed = pack_sequences(ids, lengths, pad_individual=pad_individual, pad_packed_multiple=8)
    packed_logits = packed_model(
        packed.packed_local,
        packed_position_ids(packed.cu_seqlens_padded),
        None,
        packed_seq_params=packed.packed_seq_params,
    )  # [1, T, V]
    rows = unpack_sequences(packed_logits, packed.cu_seqlens, packed.cu_seqlens_padded, WIDTH)
    packed_lp = _next_token_logprobs(rows, ids)
    (packed_lp * real * weights).sum().backward()
    return {
        "padded_lp": (padded_lp * real).detach(),
        "packed_lp": (packed_lp * real).detach(),
        "padded_grads": _grads(padded_model),
        "packed_grads": _grads(packed_model),
    }


@pytest.mark.parametrize(
    ("position_embedding_type", "pad_individual", "num_query_groups"),
    [("learned_absolute", 1, 4), ("learned_absolute", 4, 2), ("rope", 4, 4)],
)
def test_packed_matches_padded_forward_and_backward(
    position_embedding_type: str, pad_individual: int, num_query_groups: int
) -> None:
    (out,) = run_on_ranks(
        _packed_vs_padded, 1, position_embedding_type, pad_individual, num_query_groups
    )
    torch.testing.assert_close(out["packed_lp"], out["padded_lp"], atol=1e-5, rtol=1e-5)
    assert out["packed_grads"].keys() == out["padded_grads"].keys()
    for name, grad in out["padded_grads"].items():
        torch.testing.assert_close(out["packed_grads"][name], grad, atol=1e-5, rtol=1e-5, msg=name)


def _padded_mode(rank: int) -> dict[str, torch.Tensor]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from lightning_mcore_rl.models.layers import get_packed_local_layer_spec
    from lightning_mcore_rl.testing import init_megatron_state, tiny_gpt

    init_megatron_state()
    ids, _ = _batch()
    positions = torch.arange(WIDTH)[None, :].expand(len(LENGTHS), -1)
    causal_masked_out = torch.ones(1, 1, WIDTH, WIDTH, dtype=torch.bool).triu(1)  # True = masked
    reference = tiny_gpt(transformer_layer_spec=get_gpt_layer_local_spec())
    model = tiny_gpt(transformer_layer_spec=get_packed_local_layer_spec())
    with torch.no_grad():
        return {
            "reference": reference(ids, positions, None),
            "implicit_causal": model(ids, positions, None),
            "explicit_mask": model(ids, positions, causal_masked_out),
        }


def test_padded_mode_matches_megatron_dot_product_attention() -> None:
    (out,) = run_on_ranks(_padded_mode, 1)
    torch.testing.assert_close(out["implicit_causal"], out["reference"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["explicit_mask"], out["reference"], atol=1e-5, rtol=1e-5)


def _core_attention_cases(rank: int) -> dict[str, dict[str, torch.Tensor]]:
    """Padded input through ``PackedDotProductAttention`` (SDPA) and megatron's
    ``DotProductAttention`` on the same q/k/v: outputs and q/k/v gradients per case."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend, AttnMaskType

    from lightning_mcore_rl.models.layers import PackedDotProductAttention
    from lightning_mcore_rl.testing import init_megatron_state, tiny_gpt_config
    from lightning_mcore_rl.train import causal_attention_mask

    init_megatron_state()
    s, b, heads, groups, dim = 16, 3, 4, 2, 16
    generator = torch.Generator().manual_seed(3)
    qkv = [
        torch.randn(s, b, n, dim, generator=generator) for n in (heads, groups, groups)
    ]  # [s, b, np|ng, hn]
    causal = torch.ones(1, 1, s, s, dtype=torch.bool).triu(1)  # True = masked out
    padding = causal | (torch.arange(s) >= 11)[None, None, None, :]  # keys past 11 masked too
    cases = {
        "causal_none": ({}, None),
        "shared_mask": ({}, causal_attention_mask(s)),  # the strategy's: known without reading
        "causal_mask": ({}, causal),
        "causal_mask_per_row": ({}, causal.expand(b, 1, s, s)),
        "window": ({"window_size": (3, 0)}, causal),
        "layer_scaling": ({"apply_query_key_layer_scaling": True}, causal),
        "padding_mask": ({}, padding),  # not causal: megatron's softmax
        "unfused": ({"attention_backend": AttnBackend.unfused}, causal),
    }
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, (overrides, mask) in cases.items():
        config = tiny_gpt_config(
            num_attention_heads=heads, num_query_groups=groups, kv_channels=dim, **overrides
        )
        ours = PackedDotProductAttention(config, 2, AttnMaskType.causal, "self")
        result = {"sdpa": torch.tensor(ours._padded_is_causal(*qkv[:2], mask, ours.attn_mask_type))}
        for label, attention in (
            ("ours", ours),
            ("megatron", DotProductAttention(config, 2, AttnMaskType.causal, "self")),
        ):
            inputs = [x.clone().requires_grad_() for x in qkv]
            o = attention(*inputs, mask)  # [s, b, np*hn]
            (o * torch.linspace(-1, 1, o.numel()).reshape(o.shape)).sum().backward()
            result[label] = o.detach()
            for tag, x in zip("qkv", inputs, strict=True):
                result[f"{label}_d{tag}"] = x.grad
        out[name] = result
    return out


def test_padded_sdpa_matches_megatron_dot_product_attention() -> None:
    """Causal padded input (mask ``None``, the strategy's shared causal mask, another ``[1|b, 1,
    s, s]`` causal mask, a sliding window, query-key layer scaling) runs SDPA and equals megatron's ``DotProductAttention`` within fp32 rounding
    (measured <= 7.2e-7 on the outputs and gradients); a non-causal mask and the ``unfused``
    backend run megatron's attention itself (bitwise)."""
    (out,) = run_on_ranks(_core_attention_cases, 1)
    takes_sdpa = {name: bool(case["sdpa"]) for name, case in out.items()}
    assert takes_sdpa == {
        "causal_none": True,
        "shared_mask": True,
        "causal_mask": True,
        "causal_mask_per_row": True,
        "window": True,
        "layer_scaling": True,
        "padding_mask": False,
        "unfused": False,
    }
    for name, case in out.items():
        for key in ("", "_dq", "_dk", "_dv"):
            ours, reference = case[f"ours{key}"], case[f"megatron{key}"]
            if takes_sdpa[name]:
                torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-5, msg=name + key)
            else:
                assert torch.equal(ours, reference), name + key
    # the window acts: it differs from full causal attention
    assert not torch.allclose(out["window"]["ours"], out["causal_mask"]["ours"], atol=1e-3)
