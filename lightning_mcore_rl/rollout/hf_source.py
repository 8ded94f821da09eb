"""A Hugging Face ``transformers`` copy of the policy as a `RolloutSource`, refit from the
trainer's HF export. Shapes: ``B`` sequences, ``P`` prompt tokens, ``N`` new tokens."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mcore_rl._compat import kv_cache_kwargs
from lightning_mcore_rl.rollout.pending import OneRankRolloutSource
from lightning_mcore_rl.rollout.sampler import draw_tokens
from lightning_mcore_rl.rollout.source import SamplingConfig


class HFRolloutSource(OneRankRolloutSource):
    """Generate with an ``AutoModelForCausalLM`` on the first rank of ``group``; broadcast it.

    Args:
        hf_dir: the policy's HF checkpoint, read by the generating rank; serves until a refit.
        group: the ranks that share one rollout (all pass the same prompts).
        dtype: the generator's parameter dtype (refit tensors are cast to it)."""

    # In the recipes ``group`` is a DP replica's model-parallel group: each replica has one
    # generator, its TP/PP rank 0. It samples with a KV-cached loop over the model's forward, not
    # ``generate()``: the per-token logprobs are exact and the draw uses a seeded generator
    # (``generate()`` draws from torch's global RNG).

    refit_required: ClassVar[bool] = True

    def __init__(
        self,
        hf_dir: str | os.PathLike[str],
        group: Any,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.group = group
        self.src = dist.get_process_group_ranks(group)[0]
        self.dtype = dtype
        self.model: torch.nn.Module | None = None
        if dist.get_rank() == self.src:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=dtype).eval()

    @property
    def is_generator(self) -> bool:
        """Whether this rank holds the model and samples."""
        return self.model is not None

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Copy every ``(hf_name, full tensor)`` into the model (generator) or drop it (others).

        Raises:
            ValueError: an unknown name or a parameter missing (every rank, after the stream)."""
        # Every rank of the training world takes part (the export is collective); the generator
        # copies one tensor at a time, so a rank holds only the tensor in flight (its TP-gathered
        # shards and the merged full tensor) beyond its own model.
        if self.model is None:
            for _ in weights:  # take part in the collective export, keep nothing
                pass
            error: list[str | None] = [None]
        else:
            error = [self._copy(weights, dict(self.model.named_parameters(remove_duplicate=False)))]
        dist.broadcast_object_list(error, src=self.src, group=self.group)
        if error[0] is not None:
            raise ValueError(f"HFRolloutSource.update_weights: the weight stream has {error[0]}.")

    @staticmethod
    def _copy(weights: Iterable[tuple[str, Tensor]], params: dict[str, Tensor]) -> str | None:
        """Copy the stream into ``params`` (all names, tied ones repeated); what went wrong."""
        unknown: list[str] = []
        # by id: a tied weight appears under several names and counts once
        filled: set[int] = set()
        for name, tensor in weights:
            param = params.get(name)
            if param is None:
                unknown.append(name)
                continue
            param.copy_(tensor)
            filled.add(id(param))
        missing = sorted(name for name, p in params.items() if id(p) not in filled)
        if unknown or missing:
            return f"unknown names {unknown[:8]}, missing parameters {missing[:8]}"
        return None

    def _draw(
        self, tokens: Tensor, logprobs: Tensor, lengths: Tensor, sampling: SamplingConfig
    ) -> Tensor | None:
        """Sample (`_sample`); a MoE model's routing (`_routing`) or ``None``."""
        self._sample(tokens, logprobs, lengths, sampling)
        return self._routing(tokens, lengths, tokens.shape[1] - sampling.max_new_tokens)

    def _routing(self, tokens: Tensor, lengths: Tensor, prompt_width: int) -> Tensor | None:
        """A MoE model's ``[B, P+N, L, K]`` experts per position (ascending), ``None`` if dense."""
        # One forward of the finished rows gives the routing each generation step made (the model
        # is causal), up to the fp32 rounding of the other shapes.
        assert self.model is not None  # the generator only
        topk = getattr(self.model.config, "num_experts_per_tok", None)
        if topk is None:
            return None
        batch, width = tokens.shape
        attention, positions = _left_padded_layout(lengths, prompt_width, width)
        # logits_to_keep=1: only the router logits are wanted, not the [B, P+N, V] logits
        out = self.model(
            input_ids=tokens, attention_mask=attention, position_ids=positions,
            output_router_logits=True, logits_to_keep=1,
        )  # fmt: skip
        per_layer = [
            logits.topk(int(topk), dim=-1).indices.sort(dim=-1).values.view(batch, width, -1)
            for logits in out.router_logits  # [B*(P+N), E] per MoE layer, batch-major
        ]
        return torch.stack(per_layer, dim=2)

    def _sample(
        self, tokens: Tensor, logprobs: Tensor, lengths: Tensor, sampling: SamplingConfig
    ) -> None:
        """Fill ``tokens``/``logprobs [B, P+N]`` from column ``P`` on, in place, for prompts of
        ``lengths [B]`` real tokens (left-padded): prefill, then one cached step per token."""
        assert self.model is not None  # the generator only
        # the embedded sampler's draw (`draw_tokens`): softmax(logits / T), top-k/top-p filtered,
        # from a CPU generator seeded by ``sampling.seed``
        generator = torch.Generator().manual_seed(sampling.seed)
        prompt_width, width = int(tokens.shape[1] - sampling.max_new_tokens), tokens.shape[1]
        # padding masked out of the attention and positions from each prompt's first real token:
        # a row's tokens and logprobs do not depend on the padding (up to fp32 rounding)
        attention, positions = _left_padded_layout(lengths, prompt_width, width)
        stop_ids = torch.tensor(sampling.stop_token_ids, dtype=torch.long)
        stopped = torch.zeros(tokens.shape[0], dtype=torch.bool)
        out = self.model(
            input_ids=tokens[:, :prompt_width],
            attention_mask=attention[:, :prompt_width],
            position_ids=positions[:, :prompt_width],
            use_cache=True,
            logits_to_keep=1,
        )
        for pos in range(prompt_width, width):
            nxt, picked = draw_tokens(
                out.logits[:, -1, :], generator, sampling.temperature, sampling.top_k,
                sampling.top_p,
            )  # fmt: skip
            tokens[:, pos : pos + 1] = nxt
            logprobs[:, pos : pos + 1] = picked
            stopped |= torch.isin(nxt[:, 0], stop_ids)
            if pos + 1 == width or bool(stopped.all()):
                return
            out = self.model(
                input_ids=nxt,
                attention_mask=attention[:, : pos + 1],
                position_ids=positions[:, pos : pos + 1],
                use_cache=True,
                **kv_cache_kwargs(out),
            )


def _left_padded_layout(lengths: Tensor, prompt_width: int, width: int) -> tuple[Tensor, Tensor]:
    """``(attention_mask, position_ids)`` ``[B, width]`` of left-padded prompts of ``lengths``
    real tokens."""
    pads = (prompt_width - lengths)[:, None]  # [B, 1]
    columns = torch.arange(width)[None, :]
    return (columns >= pads).long(), (columns - pads).clamp(min=0)
