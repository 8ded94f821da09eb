"""What every recipe shares: the model choice (:class:`TinyGPTSpec` or :class:`HFModelSpec`), its
chunk building and the frozen initial weights (:class:`RecipeModel`), and the per-rank loaders of
the recipes' DataModules (:func:`rank_train_loader`, :func:`rank_val_loader`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from lightning.pytorch.strategies import ParallelStrategy
from torch.utils.data import DataLoader, Dataset

from lightning_mcore_rl.megatron_defaults import local_spec_settings
from lightning_mcore_rl.module import MCoreRLModule
from lightning_mcore_rl.parallel import unwrap_model as unwrap
from lightning_mcore_rl.rollout import ModularCountingTask
from lightning_mcore_rl.strategy import ResumableLoader, resumable_dataloader

if TYPE_CHECKING:
    from lightning.pytorch import Trainer

    from lightning_mcore_rl.models import HFBridge
    from lightning_mcore_rl.parallel import ParallelGroups


DEFAULT_TASK = ModularCountingTask()
"""The recipes' default task (frozen, so one shared instance is safe)."""


@dataclass
class TinyGPTSpec:
    """Size of the model (a megatron-core ``GPTModel`` with the local layer spec).

    Attributes:
        num_layers: transformer layers.
        hidden_size: ``H``.
        num_attention_heads: heads (divisible by TP).
        seed: weight seed (weights are identical under any TP layout).
        mtp_num_layers: megatron's multi-token-prediction layers on the last stage (0: none);
            they train next to the recipe's loss and log ``mtp_loss``
            (:mod:`lightning_mcore_rl.train.mtp`).
        mtp_loss_scaling_factor: weight of the MTP term in the gradient (megatron's
            ``mtp_loss_scaling_factor``, divided over the depths).
    """

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    seed: int = 0
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.mtp_num_layers, bool) or not isinstance(self.mtp_num_layers, int):
            raise TypeError(
                f"TinyGPTSpec.mtp_num_layers must be an int >= 0, got {self.mtp_num_layers!r}."
            )
        if self.mtp_num_layers < 0:
            raise ValueError(
                f"TinyGPTSpec.mtp_num_layers must be >= 0 (0: no MTP), got {self.mtp_num_layers}."
            )
        if self.mtp_num_layers and self.mtp_loss_scaling_factor < 0:
            raise ValueError(
                "TinyGPTSpec.mtp_loss_scaling_factor must be >= 0, got "
                f"{self.mtp_loss_scaling_factor}."
            )


@dataclass
class HFModelSpec:
    """A Hugging Face causal LM as the model (see ``docs/models.md`` for the architectures).

    Attributes:
        path: a directory with ``config.json`` and ``*.safetensors``; its vocabulary must cover
            the data's token ids and ``max_position_embeddings`` the longest row.
    """

    path: str


ModelSpec = TinyGPTSpec | HFModelSpec
"""A recipe's model choice."""


class RecipeModel:
    """A recipe's model: builds its chunks and swaps its initial weights back in.

    Args:
        spec: the tiny GPT's size or the Hugging Face checkpoint.
        vocab_size: ``V`` of the data: the tiny GPT is built with it; an HF model's vocabulary
            must cover it.
        max_sequence_length: the longest row: the tiny GPT's position table; an HF model's
            ``max_position_embeddings`` must cover it.
        length_name: how the recipe derives ``max_sequence_length`` (for the error message).
    """

    def __init__(
        self,
        spec: ModelSpec,
        vocab_size: int,
        max_sequence_length: int,
        length_name: str = "max_sequence_length",
    ) -> None:
        self.spec = spec
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.length_name = length_name
        self._bridge: HFBridge | None = None

    def hf_bridge(self) -> HFBridge:
        """The :class:`~lightning_mcore_rl.models.HFBridge` of an :class:`HFModelSpec`, checked
        against the data (``ValueError``: vocabulary or positions too small; read once)."""
        from lightning_mcore_rl.models import HFBridge

        spec = self.spec
        if not isinstance(spec, HFModelSpec):
            raise TypeError(f"the model is a {type(spec).__name__}, not an HFModelSpec")
        if self._bridge is None:
            bridge = HFBridge.from_pretrained(spec.path)
            if bridge.vocab_size < self.vocab_size:
                raise ValueError(
                    f"The HF model at {spec.path!r} has vocab_size={bridge.vocab_size}, below the "
                    f"data's vocab_size={self.vocab_size}; its token ids would not exist."
                )
            positions = bridge.arch.max_position_embeddings
            if positions < self.max_sequence_length:
                raise ValueError(
                    f"The HF model at {spec.path!r} has max_position_embeddings={positions}, "
                    f"below {self.length_name} = {self.max_sequence_length}."
                )
            self._bridge = bridge
        return self._bridge

    def build_chunk(self, module: MCoreRLModule, vp_stage: int | None) -> torch.nn.Module:
        """The chunk for ``vp_stage`` with ``module``'s strategy config: the tiny GPT
        (layout-invariant deterministic weights, dropout off) or the HF checkpoint's shards."""
        from lightning_mcore_rl.models.tiny_gpt import tiny_gpt

        spec, groups = self.spec, module.parallel_groups
        if isinstance(spec, HFModelSpec):
            bridge = self.hf_bridge()
            config = module.transformer_config(**bridge.config_fields())
            return bridge.build_chunk(config, vp_stage, groups=groups)
        config = module.transformer_config(
            num_layers=spec.num_layers,
            hidden_size=spec.hidden_size,
            num_attention_heads=spec.num_attention_heads,
            ffn_hidden_size=4 * spec.hidden_size,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            mtp_num_layers=spec.mtp_num_layers or None,
            mtp_loss_scaling_factor=spec.mtp_loss_scaling_factor,
            **local_spec_settings(),
        )
        return tiny_gpt(
            config,
            groups=groups,
            vocab_size=self.vocab_size,
            max_sequence_length=self.max_sequence_length,
            seed=spec.seed,
            vp_stage=vp_stage,
        )

    @contextlib.contextmanager
    def initial_weights(
        self, chunks: Sequence[torch.nn.Module], groups: ParallelGroups
    ) -> Iterator[None]:
        """Temporarily give ``chunks`` (this rank's, of ``groups``' layout) their initial weights
        (a frozen reference model).

        The initial weights are regenerated instead of kept as a second copy (the tiny GPT's are
        a pure function of the seed whatever the layout; an HF model's shards are re-read from
        its checkpoint), so a resumed run keeps the same reference. The current weights are
        restored on exit, also on error.
        """
        from lightning_mcore_rl.models.tiny_gpt import load_deterministic_weights

        spec = self.spec
        params = [p for chunk in chunks for p in chunk.parameters()]
        current = [p.detach().clone() for p in params]
        try:
            for chunk in chunks:
                if isinstance(spec, HFModelSpec):
                    self.hf_bridge().load_weights(chunk, groups)
                else:
                    load_deterministic_weights(unwrap(chunk), spec.seed, groups)
            yield
        finally:
            with torch.no_grad():
                for param, value in zip(params, current, strict=True):
                    param.copy_(value)


class RecipeModule(MCoreRLModule):
    """What every recipe module shares: its model (``self.policy``, a :class:`RecipeModel`) built
    per virtual-pipeline stage, and megatron's Adam at ``self.lr`` (clipping from
    ``Trainer(gradient_clip_val=...)``). Subclasses set both in ``__init__``."""

    policy: RecipeModel
    lr: float

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        """The model chunk for ``vp_stage`` (:meth:`RecipeModel.build_chunk`: the tiny GPT with
        layout-invariant deterministic weights, or the HF checkpoint's shards)."""
        return self.policy.build_chunk(self, vp_stage)

    def configure_optimizers(self) -> Any:
        """Megatron Adam at ``lr``, no weight decay."""
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer="adam", lr=self.lr, weight_decay=0.0)


def data_parallel_size(trainer: Trainer | None) -> int:
    """The Trainer's data-parallel size (the recipes run under ``MCoreRLStrategy``, a
    ``ParallelStrategy``; Lightning attaches the Trainer before the loader hooks)."""
    assert trainer is not None  # Lightning attaches the Trainer before the hooks
    strategy = cast(ParallelStrategy, trainer.strategy)
    return int(strategy.distributed_sampler_kwargs["num_replicas"])


def rank_train_loader(
    trainer: Trainer | None,
    dataset: Dataset,
    global_batch: int,
    name: str,
    seed: int,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    drop_last: bool = False,
) -> ResumableLoader:
    """This data-parallel rank's loader: ``global_batch / DP`` items per batch, shuffled with a
    fixed seed (re-permuted per epoch), resumable mid-epoch
    (:class:`~lightning_mcore_rl.strategy.ResumableLoader`).

    Args:
        trainer: the Trainer (set up).
        dataset: a map-style dataset.
        global_batch: items per optimizer step over all data-parallel ranks.
        name: the DataModule argument that set ``global_batch`` (for the error message).
        seed: the sampler seed.
        collate_fn: the ``DataLoader``'s collate function (default: torch's).
        drop_last: drop the epoch's last, partial batch.

    Raises:
        ValueError: ``global_batch`` is not divisible by the data-parallel size.
    """
    dp = data_parallel_size(trainer)
    check_divisible_by_dp(global_batch, dp, name)
    assert trainer is not None  # checked by data_parallel_size
    return resumable_dataloader(
        dataset, trainer, global_batch // dp, seed=seed, collate_fn=collate_fn, drop_last=drop_last
    )


def check_divisible_by_dp(global_batch: int, dp: int, name: str) -> None:
    """``ValueError`` unless ``global_batch`` (the DataModule argument ``name``) divides over the
    ``dp`` data-parallel ranks."""
    if global_batch % dp != 0:
        raise ValueError(
            f"`{name}` ({global_batch}) must be divisible by the data-parallel size ({dp})."
        )


def check_step_microbatches(
    module: MCoreRLModule, per_step: str, rows_per_item: int = 1, rows_source: str = ""
) -> None:
    """At setup, before the first step (and a recipe's first rollout): the strategy's
    ``micro_batch_size`` divides this data-parallel rank's batch, ``per_step`` (the attached
    DataModule's items per optimizer step) / DP x ``rows_per_item`` rows.

    Nothing to check with a token budget (``max_tokens_per_microbatch``) or when the Trainer has
    no DataModule with a ``per_step`` argument (loaders passed directly: the step checks).

    Args:
        module: the recipe module (attached to its Trainer).
        per_step: the DataModule argument holding the global items per step.
        rows_per_item: training rows per item (GRPO: completions per prompt; DPO: 2 per pair).
        rows_source: where ``rows_per_item`` comes from (for the message), e.g.
            ``"GRPOModule(rollout.group_size=4)"``.

    Raises:
        ValueError: ``per_step`` not divisible by DP, or ``micro_batch_size`` not dividing the
            local batch; the message names the DataModule argument, the DP size and the factor.
    """
    trainer = module.trainer
    datamodule = getattr(trainer, "datamodule", None)  # set by fit(datamodule=...)
    items = getattr(datamodule, per_step, None)
    batching = module.mcore_strategy.microbatching
    if not isinstance(items, int) or batching.max_tokens_per_microbatch is not None:
        return
    dp = data_parallel_size(trainer)
    check_divisible_by_dp(items, dp, per_step)
    rows, size = items // dp * rows_per_item, batching.micro_batch_size
    if rows % size != 0:
        factor = f" x {rows_source}" if rows_source else ""
        raise ValueError(
            f"`MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size={size}))` (YAML: "
            f"`microbatching: {{micro_batch_size: {size}}}`) must divide each data-parallel "
            f"rank's batch of {rows} rows = {type(datamodule).__name__}({per_step}={items}) / "
            f"data-parallel size {dp}{factor}. Set `micro_batch_size` to a divisor of {rows}, "
            f"or change `{per_step}`."
        )


def rank_val_loader(
    trainer: Trainer | None,
    dataset: Dataset,
    global_batch: int,
    name: str,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> DataLoader:
    """A validation loader of ``dataset`` (``len(dataset)`` items, named ``name``) in batches of
    ``global_batch / DP``; Lightning gives each data-parallel rank its share (a
    ``DistributedSampler`` over the DP group, no shuffling).

    Raises:
        ValueError: ``len(dataset)`` is not divisible by the data-parallel size.
    """
    dp = data_parallel_size(trainer)
    size = len(cast(Any, dataset))  # map-style datasets of the recipes are sized
    if size % dp != 0:
        raise ValueError(
            f"`{name}` ({size}) must be divisible by the data-parallel size ({dp}): every rank "
            "must run the same number of batches."
        )
    return DataLoader(dataset, batch_size=max(global_batch // dp, 1), collate_fn=collate_fn)


def agree_on_batch(module: MCoreRLModule, check: Callable[[], None]) -> None:
    """Run a recipe's host-side batch ``check`` on every rank and agree on the verdict (one
    all-reduce, ``reduce_boolean_decision``) before the step's first collective: the rank whose
    batch is bad raises its ``ValueError``/``TypeError``, the others a ``BatchRejectedError``
    naming each rejecting rank and its reason (one more collective, only then:
    :func:`~lightning_mcore_rl.reliability.nonfinite.batch_rejection`), instead of waiting for it
    in the step."""
    from lightning_mcore_rl.reliability.nonfinite import batch_rejection

    error: ValueError | TypeError | None = None
    try:
        check()
    except (ValueError, TypeError) as err:
        error = err
    strategy = module.mcore_strategy
    if strategy.reduce_boolean_decision(error is not None, all=False):
        raise batch_rejection(error, strategy.world_group, f" in {type(module).__name__}")


def check_rows(
    owner: str, batch: Mapping[str, Any], keys: Sequence[str], max_sequence_length: int
) -> None:
    """The recipe-level checks of a ``loss_fn`` batch (the strategy checks shapes, dtypes and
    masks): ``keys`` present, rows no wider than the model's ``max_sequence_length``.

    Raises:
        ValueError: naming ``owner``, the key and the expected and actual values.
    """
    if not isinstance(batch, Mapping):
        raise TypeError(f"{owner} takes a mapping batch, got {type(batch).__name__}.")
    for key in keys:
        if key not in batch:
            raise ValueError(
                f"{owner}'s batch is missing the key `{key}` (present: {sorted(batch)})."
            )
    width = int(batch["input_ids"].shape[-1])
    if width > max_sequence_length:
        raise ValueError(
            f"{owner}: `input_ids` rows are {width} tokens wide, above the model's "
            f"max_sequence_length={max_sequence_length}."
        )
