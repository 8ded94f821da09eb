"""Rank functions of ``test_module_hooks``: the ``MCoreRLModule`` post-processing hooks and
forward-only passes under a Trainer, against a plain-torch reference built from the same
layout-invariant tiny GPT at TP=1.

Each hook override is a one-hook subclass of the fitted module's class; inside one ``fit`` the
probe swaps the module's class to it (:func:`_as_class`) for one call, so every override is
measured on the same weights in the same run (one spawn per layout keeps the tests fast).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from _strategy_rl_runs import PG_CFG, RolloutRows
from _strategy_runs import VOCAB
from lightning.pytorch import Callback, Trainer
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_mcore_rl import MCoreRLModule, MCoreRLStrategy
from lightning_mcore_rl.data import BatchedDataDict
from lightning_mcore_rl.losses import ClippedPGLossFn
from lightning_mcore_rl.models.tiny_gpt import tiny_gpt, tiny_gpt_config
from lightning_mcore_rl.ops import TrainingSamplingParams
from lightning_mcore_rl.strategy import MicrobatchConfig
from lightning_mcore_rl.testing import init_megatron_state
from lightning_mcore_rl.train import LossPostProcessor

TEMPERATURE = 2.0
OVERRIDE_TEMPERATURE = 0.5
TOP_K = 32  # of V = 128: about a quarter of the random next tokens survive the filter
K = 5
OVERRIDE_K = 7
LOSS_SCALE = 3.0
BATCH = 4


def probe_batch() -> BatchedDataDict:
    """Four right-padded GRPO rows ``[4, S]`` (fixed: every step and probe reads the same)."""
    rows = RolloutRows(BATCH, seed=3)
    items = [rows[i] for i in range(BATCH)]
    return BatchedDataDict({k: torch.stack([r[k] for r in items]) for k in items[0]})


def _trainer_options(devices: int, **kwargs: Any) -> dict[str, Any]:
    return {
        "accelerator": "cpu",
        "devices": devices,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        **kwargs,
    }


class _Recorder(Callback):
    """Each step's ``callback_metrics`` as floats."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: Any, *args: Any) -> None:
        self.rows.append({k: float(v) for k, v in trainer.callback_metrics.items()})


@contextlib.contextmanager
def _as_class(module: MCoreRLModule, cls: type) -> Iterator[None]:
    """Run the block with ``module`` as an instance of ``cls`` (a one-hook subclass)."""
    original = type(module)
    module.__class__ = cls
    try:
        yield
    finally:
        module.__class__ = original


class ProbeModule(MCoreRLModule):
    """The tiny GPT with a ClippedPG loss at temperature 2; the first training step runs
    ``probe`` (train mode, inside fit), every step trains on :func:`probe_batch`, the second one
    as ``loss_override`` when that is set."""

    loss_override: type | None = None

    def __init__(self, dropout: float = 0.0, lr: float = 0.0) -> None:
        super().__init__(
            loss_fn=ClippedPGLossFn(PG_CFG),
            sampling_params=TrainingSamplingParams(temperature=TEMPERATURE),
        )
        self.dropout = dropout
        self.lr = lr
        self.batch = probe_batch()
        self.probes: dict[str, Any] = {}

    @property
    def ids(self) -> Tensor:
        """The probe batch's ``input_ids [B, S]``."""
        return cast(Tensor, self.batch["input_ids"])

    def build_chunk(self, vp_stage: int | None) -> torch.nn.Module:
        config = tiny_gpt_config(
            self.parallel_groups,
            calculate_per_token_loss=True,
            hidden_dropout=self.dropout,
            attention_dropout=self.dropout,
        )
        return tiny_gpt(
            config, groups=self.parallel_groups, vocab_size=VOCAB, seed=0, vp_stage=vp_stage
        )

    def configure_optimizers(self) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        # lr = 0: every step sees the same weights, so two steps' grad norms compare exactly
        return OptimizerConfig(optimizer="adam", lr=self.lr, adam_eps=1e-4, weight_decay=0.0)

    def probe(self) -> dict[str, Any]:
        raise NotImplementedError

    def training_step(self, batch: Any, batch_idx: int = 0) -> dict[str, Any]:
        if batch_idx == 0:
            self.probes = self.probe()
        scope = (
            _as_class(self, self.loss_override)
            if self.loss_override is not None and batch_idx == 1
            else contextlib.nullcontext()
        )
        with scope:
            return self.forward_backward(self.batch).as_step_result()


# ---------------------------------------------------------------- one-hook subclasses


class SamplingOverride(ProbeModule):
    """Its own fit: the strategy asks ``sampling_params()`` once, in ``setup``."""

    def sampling_params(self) -> TrainingSamplingParams | None:
        return TrainingSamplingParams(temperature=OVERRIDE_TEMPERATURE)

    def probe(self) -> dict[str, Any]:
        return {"sampling_override": self.compute_logprobs(self.batch)}


class LogprobsOverride(ProbeModule):
    def logprobs_post_processor(self) -> Any:
        from lightning_mcore_rl.train import LogprobsPostProcessor

        params = TrainingSamplingParams(temperature=TEMPERATURE, top_k=TOP_K)
        return LogprobsPostProcessor(self.mcore_strategy.policy_config(), sampling_params=params)


class TopkOverride(ProbeModule):
    def topk_logits_post_processor(self, k: int) -> Any:
        from lightning_mcore_rl.train import TopkLogitsPostProcessor

        return TopkLogitsPostProcessor(self.mcore_strategy.policy_config(), OVERRIDE_K)


class PayloadOverride(ProbeModule):
    """bf16 payload and top-k filtered sampled-token logprobs, whatever was asked."""

    def teacher_payload_post_processor(self, payload: str, payload_dtype: torch.dtype) -> Any:
        from lightning_mcore_rl.train import TeacherFullPayloadPostProcessor

        params = TrainingSamplingParams(temperature=TEMPERATURE, top_k=TOP_K)
        return TeacherFullPayloadPostProcessor(
            self.mcore_strategy.policy_config(), payload, torch.bfloat16, sampling_params=params
        )


class ScaledLossPostProcessor(LossPostProcessor):
    """The default loss post-processor with the loss (and its logged value) times 3."""

    def __call__(self, *args: Any, **kwargs: Any) -> Callable[[Tensor], Any]:
        fn = super().__call__(*args, **kwargs)

        def scaled(output: Tensor) -> tuple[Tensor, dict[str, Any]]:
            loss, metrics = fn(output)
            return loss * LOSS_SCALE, {**metrics, "loss": metrics["loss"] * LOSS_SCALE}

        return scaled


class ScaledLoss(ProbeModule):
    """An override in the fixed signature's old style: ``num_microbatches`` required,
    positional (the strategy asks ``loss_post_processor(None)``)."""

    def loss_post_processor(self, num_microbatches):
        assert self.loss_fn is not None
        return ScaledLossPostProcessor(
            self.loss_fn,
            self.mcore_strategy.policy_config(),
            num_microbatches,
            sampling_params=self.sampling_params(),
        )


# ---------------------------------------------------------------- TP=2: every hook


class TPProbe(ProbeModule):
    loss_override = ScaledLoss

    def probe(self) -> dict[str, Any]:
        b = self.batch
        out: dict[str, Any] = {
            "logprobs": self.compute_logprobs(b),
            "topk": self.compute_topk_logits(b, K),
            "payload_logits": self.compute_teacher_payload(b, "logits", torch.float32),
            "payload_hidden": self.compute_teacher_payload(b, "hidden_states", torch.float32),
        }
        with _as_class(self, LogprobsOverride), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "valid prev_logprobs entries are -inf" (filtered)
            out["logprobs_override"] = self.compute_logprobs(b)
        with _as_class(self, TopkOverride):
            out["topk_override"] = self.compute_topk_logits(b, K)
        with _as_class(self, PayloadOverride), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out["payload_override"] = self.compute_teacher_payload(b, "logits", torch.float32)
        out["loss_m"] = {
            "default": self.loss_post_processor().num_microbatches,
            "default_4": self.loss_post_processor(4).num_microbatches,
        }
        with _as_class(self, ScaledLoss):
            out["loss_m"]["override_4"] = self.loss_post_processor(4).num_microbatches
        return out


@dataclass(frozen=True)
class Reference:
    """The TP=1 model's fp32 logits ``[B, S, V]``, final hidden states ``[B, S, H]`` (input of
    the output layer) and output-layer weight ``[V, H]``."""

    logits: Tensor
    hidden: Tensor
    output_weight: Tensor


@dataclass(frozen=True)
class HookRun:
    """One rank: the probe batch's ids, the probes, each step's metrics, the TP=1 reference."""

    ids: Tensor
    probes: dict[str, Any]
    rows: list[dict[str, float]]
    reference: Reference
    global_step: int


def reference_forward(ids: Tensor, dropout: float = 0.0, seed: int = 0) -> Reference:
    """The same tiny GPT (weights of ``seed``) built at TP=1 (megatron re-initialised: DP =
    world size), eval mode, called directly (no schedule, no post-processor)."""
    init_megatron_state()
    config = tiny_gpt_config(hidden_dropout=dropout, attention_dropout=dropout)
    model = tiny_gpt(config, vocab_size=VOCAB, seed=seed).eval()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        logits = model(ids, positions, mask)  # [B, S, V]
        embedded = model.embedding(input_ids=ids, position_ids=positions)  # [S, B, H]
        hidden = model.decoder(hidden_states=embedded, attention_mask=mask)  # [S, B, H]
    return Reference(
        logits=logits.float(),
        hidden=hidden.transpose(0, 1).contiguous(),
        output_weight=model.output_layer.weight.detach().clone(),
    )


def tp_hooks_rank(rank: int) -> HookRun:
    recorder = _Recorder()
    trainer = Trainer(
        **_trainer_options(
            2,
            strategy=MCoreRLStrategy(
                tensor_model_parallel_size=2, microbatching=MicrobatchConfig(micro_batch_size=2)
            ),
            max_steps=2,
            callbacks=[recorder],
        )
    )
    module = TPProbe()
    trainer.fit(module, DataLoader(RolloutRows(2 * BATCH), batch_size=BATCH))
    override = SamplingOverride()  # the same initial weights, probed at its first step
    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=2, microbatching=MicrobatchConfig(micro_batch_size=2)
    )
    Trainer(**_trainer_options(2, strategy=strategy, max_steps=1)).fit(
        override, DataLoader(RolloutRows(BATCH), batch_size=BATCH)
    )
    ids = module.ids
    return HookRun(
        ids=ids,
        probes={**module.probes, **override.probes},
        rows=recorder.rows,
        reference=reference_forward(ids),
        global_step=trainer.global_step,
    )


# ---------------------------------------------------------------- PP=2 + dropout


def _flags(module: MCoreRLModule) -> list[tuple[str, bool]]:
    return [
        (f"{i}.{name}", m.training)
        for i, chunk in enumerate(module.mcore_strategy.model_chunks)
        for name, m in chunk.named_modules()
    ]


class PPDropoutProbe(ProbeModule):
    def probe(self) -> dict[str, Any]:
        from lightning_mcore_rl.train.forward import _unwrap

        b = self.batch
        before = _flags(self)
        dropout_active = None
        gpt = _unwrap(self.mcore_strategy.model_chunks[0])
        if gpt.pre_process and not gpt.post_process:  # first stage: hidden states out
            ids = self.ids
            positions = torch.arange(ids.shape[1]).expand_as(ids)
            mask = torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool).triu(1)[None, None]
            with torch.no_grad():
                first, second = (gpt(ids, positions, mask) for _ in range(2))
            dropout_active = not torch.equal(first, second)
        out = {
            "flags_before": before,
            "dropout_active": dropout_active,
            "logprobs": self.compute_logprobs(b),
            "logprobs_again": self.compute_logprobs(b),
            "flags_after": _flags(self),
            "payload_logits": self.compute_teacher_payload(b, "logits", torch.float32),
        }
        return out


def pp_dropout_rank(rank: int) -> HookRun:
    trainer = Trainer(
        **_trainer_options(
            2,
            strategy=MCoreRLStrategy(
                pipeline_model_parallel_size=2, microbatching=MicrobatchConfig(micro_batch_size=2)
            ),
            max_steps=1,
        )
    )
    module = PPDropoutProbe(dropout=0.5, lr=1e-3)
    trainer.fit(module, DataLoader(RolloutRows(BATCH), batch_size=BATCH))
    ids = module.ids
    return HookRun(
        ids=ids,
        probes=module.probes,
        rows=[],
        reference=reference_forward(ids, dropout=0.5),
        global_step=trainer.global_step,
    )


# ---------------------------------------------------------------- GRPO recipe + CPU backend


class _Scope(Callback):
    """Whether the CPU backend is active while the Trainer runs a training batch."""

    def __init__(self) -> None:
        self.active: list[bool] = []

    def on_train_batch_start(self, trainer: Trainer, module: Any, batch: Any, idx: int) -> None:
        from lightning_mcore_rl.cpu import emulation_active

        self.active.append(emulation_active())


@dataclass(frozen=True)
class GRPORun:
    """One GRPO fit: its logged metrics and the CPU backend's state before, inside and after."""

    temperature: float
    metrics: dict[str, float]
    global_step: int
    active_before: bool
    active_inside: list[bool]
    active_after: bool
    current_device_restored: bool


def grpo_scope_rank(rank: int, temperatures: tuple[float, ...]) -> list[GRPORun]:
    """One on-policy GRPO step per temperature (smallest recipe settings), each fit checking that
    the CPU backend is scoped to it. Run WITHOUT ``run_on_ranks``' emulation."""
    from lightning_mcore_rl.cpu import emulation_active
    from lightning_mcore_rl.recipes import GRPOModule, PromptDataModule, RolloutSpec

    original_current_device = torch.cuda.current_device
    runs = []
    for temperature in temperatures:
        scope = _Scope()
        active_before = emulation_active()
        trainer = Trainer(
            **_trainer_options(
                int(os.environ["WORLD_SIZE"]),
                strategy=MCoreRLStrategy(microbatching=MicrobatchConfig(micro_batch_size=4)),
                max_steps=1,
                callbacks=[scope],
            )
        )
        module = GRPOModule(
            rollout=RolloutSpec(group_size=2, max_new_tokens=4, temperature=temperature)
        )
        trainer.fit(module, datamodule=PromptDataModule(prompts_per_step=2, num_steps=1))
        runs.append(
            GRPORun(
                temperature=temperature,
                metrics={k: float(v) for k, v in trainer.callback_metrics.items()},
                global_step=trainer.global_step,
                active_before=active_before,
                active_inside=scope.active,
                active_after=emulation_active(),
                current_device_restored=torch.cuda.current_device is original_current_device,
            )
        )
    return runs
