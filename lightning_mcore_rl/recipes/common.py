"""What every recipe shares: the model choice (`TinyGPTSpec` or `HFModelSpec`), its chunks and
initial weights (`RecipeModel`), and the per-rank loaders of the recipes' DataModules."""

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
        mtp_num_layers: megatron's multi-token-prediction layers on the last stage (0: none).
        mtp_loss_scaling_factor: weight of the MTP term in the gradient, divided over the depths."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    seed: int = 0
    # MTP layers train next to the recipe's loss and log mtp_loss
    # (`lightning_mcore_rl.extensions.multi_token_prediction`)
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
    """A Hugging Face causal LM as the model (architectures: ``docs/models.md``).

    Attributes:
        path: a directory with ``config.json`` and ``*.safetensors``."""

    # its vocabulary must cover the data's token ids, max_position_embeddings the longest row
    path: str


ModelSpec = TinyGPTSpec | HFModelSpec
"""A recipe's model choice."""


class RecipeModel:
    """A recipe's model of ``spec`` for data of ``vocab_size`` and rows of ``max_sequence_length``
    (derived as ``length_name`` says): builds its chunks and swaps its initial weights back in."""

    # An HF model's vocabulary and max_position_embeddings must cover vocab_size and
    # max_sequence_length; the tiny GPT is built with them.
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
        """The `HFBridge` of an `HFModelSpec`, read once.

        Raises:
            TypeError: not an `HFModelSpec`.
            ValueError: its vocabulary or positions are too small for the data."""
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
        """The tiny GPT's chunk for ``vp_stage`` or the HF checkpoint's shards."""
        from lightning_mcore_rl.models.tiny_gpt import tiny_gpt

        spec, groups = self.spec, module.parallel_groups
        if isinstance(spec, HFModelSpec):
            bridge = self.hf_bridge()
            config = module.transformer_config(**bridge.config_fields())
            return bridge.build_chunk(config, vp_stage, groups=groups)
        # layout-invariant deterministic weights, dropout off
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
        (a frozen reference model); the current ones are restored on exit."""
        from lightning_mcore_rl.models.tiny_gpt import load_deterministic_weights

        # Regenerated instead of kept as a second copy: the tiny GPT's are a pure function of the
        # seed whatever the layout, an HF model's shards are re-read from its checkpoint; so a
        # resumed run keeps the same reference.
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
        finally:  # also on error
            with torch.no_grad():
                for param, value in zip(params, current, strict=True):
                    param.copy_(value)


class RecipeModule(MCoreRLModule):
    """What every recipe module shares: its model (``self.policy``) built per virtual-pipeline
    stage, and megatron's Adam at ``self.lr``; subclasses set both in ``__init__``."""

    # set by each subclass's __init__
    policy: RecipeModel
    lr: float

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        """The model chunk for ``vp_stage`` (`RecipeModel.build_chunk`)."""
        return self.policy.build_chunk(self, vp_stage)

    def configure_optimizers(self) -> Any:
        """Megatron Adam at ``lr``, no weight decay."""
        from megatron.core.optimizer import OptimizerConfig

        # clipping comes from Trainer(gradient_clip_val=...)
        return OptimizerConfig(optimizer="adam", lr=self.lr, weight_decay=0.0)


def data_parallel_size(trainer: Trainer | None) -> int:
    """The Trainer's data-parallel size."""
    assert trainer is not None  # Lightning attaches the Trainer before the hooks
    # the recipes run under MCoreRLStrategy, a ParallelStrategy
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
    """This DP rank's resumable, shuffled loader of ``global_batch / DP`` items per batch (``name``:
    the DataModule argument that set ``global_batch``).

    Raises:
        ValueError: ``global_batch`` is not divisible by the data-parallel size."""
    dp = data_parallel_size(trainer)
    check_divisible_by_dp(global_batch, dp, name)
    assert trainer is not None  # checked by data_parallel_size
    # a fixed seed, re-permuted per epoch; resumable mid-epoch (ResumableLoader)
    return resumable_dataloader(
        dataset, trainer, global_batch // dp, seed=seed, collate_fn=collate_fn, drop_last=drop_last
    )


def check_divisible_by_dp(global_batch: int, dp: int, name: str) -> None:
    """``ValueError`` unless ``global_batch`` (DataModule argument ``name``) divides over ``dp``."""
    if global_batch % dp != 0:
        raise ValueError(
            f"`{name}` ({global_batch}) must be divisible by the data-parallel size ({dp})."
        )


def check_step_microbatches(
    module: MCoreRLModule, per_step: str, rows_per_item: int = 1, rows_source: str = ""
) -> None:
    """At setup: the strategy's ``micro_batch_size`` divides this DP rank's batch, the DataModule's
    ``per_step`` items / DP x ``rows_per_item`` rows (``rows_source``: the factor's origin).

    Raises:
        ValueError: ``per_step`` not divisible by DP, or ``micro_batch_size`` not dividing it."""
    trainer = module.trainer
    datamodule = getattr(trainer, "datamodule", None)  # set by fit(datamodule=...)
    items = getattr(datamodule, per_step, None)
    batching = module.mcore_strategy.microbatching
    # nothing to check with a token budget, or without a DataModule holding `per_step` (loaders
    # passed directly: the step checks); checked here, before a recipe's first rollout
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
    """A validation loader of ``dataset`` (named ``name``) in batches of ``global_batch / DP``.

    Raises:
        ValueError: ``len(dataset)`` is not divisible by the data-parallel size."""
    dp = data_parallel_size(trainer)
    size = len(cast(Any, dataset))  # map-style datasets of the recipes are sized
    if size % dp != 0:
        raise ValueError(
            f"`{name}` ({size}) must be divisible by the data-parallel size ({dp}): every rank "
            "must run the same number of batches."
        )
    # no sampler here: Lightning gives each DP rank its share (a DistributedSampler over the DP
    # group, no shuffling)
    return DataLoader(dataset, batch_size=max(global_batch // dp, 1), collate_fn=collate_fn)


def agree_on_batch(module: MCoreRLModule, check: Callable[[], None]) -> None:
    """Run a recipe's host-side batch ``check`` on every rank and agree on the verdict before the
    step's first collective: the bad rank raises its error, the others a ``BatchRejectedError``."""
    from lightning_mcore_rl.reliability.nonfinite import batch_rejection

    error: ValueError | TypeError | None = None
    try:
        check()
    except (ValueError, TypeError) as err:
        error = err
    # One all-reduce; only on a rejection one more collective (`batch_rejection`) names each
    # rejecting rank and its reason, instead of the others waiting for the bad rank in the step.
    strategy = module.mcore_strategy
    if strategy.reduce_boolean_decision(error is not None, all=False):
        raise batch_rejection(error, strategy.world_group, f" in {type(module).__name__}")


def check_rows(
    owner: str, batch: Mapping[str, Any], keys: Sequence[str], max_sequence_length: int
) -> None:
    """Check that a ``loss_fn`` batch has ``keys`` and rows within ``max_sequence_length``.

    Raises:
        ValueError: naming ``owner``, the key and the expected and actual values."""
    # the strategy checks shapes, dtypes and masks
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
