"""This rank's process groups: read from megatron's parallel state once and passed down."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


# read ONCE, by the strategy in `setup_environment` through `megatron_groups`, and passed down
# explicitly: nothing below the strategy reads megatron's `parallel_state` except `resolve_groups`
# for the seed API
@dataclass(frozen=True)
class ParallelGroups:
    """This rank's megatron process groups, ranks and sizes (`ep_*`/`etp_*`: expert parallel and
    expert tensor parallel; `vpp_size`: model chunks per pipeline rank, `None` without VPP)."""

    tp_group: Any
    tp_rank: int
    tp_size: int
    pp_group: Any
    pp_rank: int
    pp_size: int
    # the global rank of this pipeline's last stage
    pp_last_rank: int
    # data parallel WITHOUT CP: CP ranks hold the same samples
    dp_group: Any
    dp_rank: int
    dp_size: int
    cp_group: Any
    cp_rank: int
    cp_size: int
    vpp_size: int | None = None
    # TP x PP of this rank's replica (None: not given; the strategy's groups always carry it)
    mp_group: Any = None
    # the ranks whose experts together make each MoE layer's E experts: EP rank r holds experts [r *
    # E/EP, (r + 1) * E/EP); the expert TP group shards one expert's weights, by default the TP
    # group (etp_size=-1)
    ep_group: Any = None
    ep_rank: int = 0
    ep_size: int = 1
    etp_group: Any = None
    etp_rank: int = -1
    etp_size: int = -1

    def __post_init__(self) -> None:
        if self.etp_size == -1:  # megatron's default: experts sharded like the dense layers
            object.__setattr__(self, "etp_group", self.tp_group)
            object.__setattr__(self, "etp_rank", self.tp_rank)
            object.__setattr__(self, "etp_size", self.tp_size)

    @classmethod
    def single(cls) -> ParallelGroups:
        """One process without parallelism: every rank 0, every size 1, no groups, no VPP."""
        return cls(
            tp_group=None, tp_rank=0, tp_size=1,
            pp_group=None, pp_rank=0, pp_size=1, pp_last_rank=0,
            dp_group=None, dp_rank=0, dp_size=1,
            cp_group=None, cp_rank=0, cp_size=1,
        )  # fmt: skip

    @property
    def is_pipeline_last_stage(self) -> bool:
        """Whether this rank holds the last pipeline stage (the loss and the outputs)."""
        return self.pp_rank == self.pp_size - 1

    def is_first_stage(self, vp_stage: int | None) -> bool:
        """Whether chunk `vp_stage` of this rank is the model's first (it embeds the tokens); raises
        `ValueError` for `vp_stage=None` under virtual pipelining."""
        self._check_vp_stage(vp_stage)
        # megatron's is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        return self.pp_rank == 0 and (self.vpp_size is None or vp_stage == 0)

    def is_last_stage(self, vp_stage: int | None) -> bool:
        """Whether chunk `vp_stage` of this rank is the model's last (it holds the output layer);
        raises `ValueError` for `vp_stage=None` under virtual pipelining."""
        self._check_vp_stage(vp_stage)
        last_chunk = self.vpp_size is None or vp_stage == self.vpp_size - 1
        return self.is_pipeline_last_stage and last_chunk

    def _check_vp_stage(self, vp_stage: int | None) -> None:
        """Raise `ValueError` for a missing chunk index under virtual pipelining."""
        # virtual pipelining needs a chunk index (megatron ignores `vp_stage` only without VPP)
        if self.vpp_size is not None and vp_stage is None:
            raise ValueError(
                f"`vp_stage` must be a chunk index in [0, {self.vpp_size}) under virtual "
                "pipelining, got None."
            )


def megatron_groups() -> ParallelGroups:
    """This rank's `ParallelGroups` from megatron's initialised `parallel_state`; `RuntimeError` if
    it is not initialised."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise RuntimeError(
            "megatron's parallel state is not initialised: call "
            "`megatron.core.parallel_state.initialize_model_parallel(...)` first, or pass "
            "`groups=ParallelGroups(...)` explicitly."
        )

    return ParallelGroups(
        tp_group=ps.get_tensor_model_parallel_group(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_size=ps.get_tensor_model_parallel_world_size(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_size=ps.get_pipeline_model_parallel_world_size(),
        pp_last_rank=ps.get_pipeline_model_parallel_last_rank(),
        dp_group=ps.get_data_parallel_group(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=ps.get_data_parallel_world_size(),
        cp_group=ps.get_context_parallel_group(),
        cp_rank=ps.get_context_parallel_rank(),
        cp_size=ps.get_context_parallel_world_size(),
        vpp_size=ps.get_virtual_pipeline_model_parallel_world_size(),
        mp_group=ps.get_model_parallel_group(),
        ep_group=ps.get_expert_model_parallel_group(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_size=ps.get_expert_model_parallel_world_size(),
        etp_group=ps.get_expert_tensor_parallel_group(),
        etp_rank=ps.get_expert_tensor_parallel_rank(),
        etp_size=ps.get_expert_tensor_parallel_world_size(),
    )


def resolve_groups(groups: ParallelGroups | None) -> ParallelGroups:
    """`groups`, or megatron's initialised state when `None` (`RuntimeError` if not initialised)."""
    # the seed API's functions are called as NeMo RL calls them, without groups; the core always
    # passes them
    return megatron_groups() if groups is None else groups
