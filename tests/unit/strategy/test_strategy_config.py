"""Construction-time validation of ``MCoreRLStrategy`` and its configs, Trainer flag mapping,
precision translation and registry (single process, no megatron state)."""

from __future__ import annotations

import inspect
import warnings
from datetime import timedelta

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import DoublePrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import StrategyRegistry

import lightning_mcore_rl
from lightning_mcore_rl.strategy import (
    CheckpointConfig,
    LogprobKernelConfig,
    MCorePrecision,
    MCoreRLStrategy,
    MegatronDDPConfig,
    MicrobatchConfig,
    ParallelSizes,
    ReliabilityConfig,
    check_trainer_flags,
)
from lightning_mcore_rl.strategy.config import FLAT_ARGUMENTS, flat_argument_warning
from lightning_mcore_rl.strategy.precision import to_mcore_precision
from lightning_mcore_rl.train import Microbatching, split_lm_batch


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tensor_model_parallel_size": 0}, "`tensor_model_parallel_size` must be a positive int"),
        ({"pipeline_model_parallel_size": -1}, "`pipeline_model_parallel_size` must be"),
        ({"context_parallel_size": 0}, "`context_parallel_size` must be"),
        ({"virtual_pipeline_model_parallel_size": 1}, "must be None or an int >= 2"),
        ({"virtual_pipeline_model_parallel_size": 2}, "needs `pipeline_model_parallel_size` >= 2"),
        ({"sequence_parallel": True}, "`sequence_parallel=True` needs"),
        ({"context_parallel_size": 2}, "needs `sequence_packing=True`"),
        (
            {"microbatching": MicrobatchConfig(micro_batch_size=0)},
            "`micro_batch_size` must be a positive int",
        ),
        ({"expert_model_parallel_size": 0}, "`expert_model_parallel_size` must be a positive"),
        ({"expert_tensor_parallel_size": -2}, "`expert_tensor_parallel_size` must be a positive"),
        (
            {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1},
            r"`expert_tensor_parallel_size=1` differs from `tensor_model_parallel_size=2`, which "
            r"needs `expert_model_parallel_size` > 1, got 1",
        ),
    ],
)
def test_bad_parallel_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MCoreRLStrategy(**kwargs)


def test_torch_ddp_options_are_not_accepted():
    with pytest.raises(TypeError, match="unexpected keyword argument 'find_unused_parameters'"):
        MCoreRLStrategy(find_unused_parameters=True)  # type: ignore[call-arg]


def test_sizes_must_divide_world_size():
    sizes = ParallelSizes(tp=2, pp=2)
    assert sizes.check_world_size(8) == 2
    with pytest.raises(
        ValueError,
        match=r"The sizes tp=2, pp=2, cp=1 multiplied \(4\) should divide the world size 2",
    ):
        sizes.check_world_size(2)


def test_expert_sizes_must_divide_world_size():
    sizes = ParallelSizes(tp=2, ep=2)  # the experts' TP defaults to the dense TP
    assert sizes.expert_tp == 2 and sizes.check_world_size(4) == 2
    with pytest.raises(
        ValueError,
        match=r"expert_tensor_parallel_size=2, expert_model_parallel_size=2, pp=1 multiplied "
        r"\(4\) should divide the world size 2",
    ):
        sizes.check_world_size(2)
    assert ParallelSizes(tp=2, ep=2, etp=1).check_world_size(2) == 1


def test_config_dataclasses_validate():
    with pytest.raises(ValueError, match="`MegatronDDPConfig.bucket_size` must be positive"):
        MegatronDDPConfig(bucket_size=0)
    with pytest.raises(ValueError, match="`CheckpointConfig.optimizer_sharding` must be"):
        CheckpointConfig(optimizer_sharding="fully_sharded_model_space")  # type: ignore[arg-type]


def test_constructor_takes_at_most_12_grouped_parameters():
    params = inspect.signature(MCoreRLStrategy).parameters
    assert len(params) == 12, list(params)
    assert list(params)[-5:] == ["microbatching", "ddp", "checkpoint", "reliability", "logprobs"]
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params.values())
    assert all(p.annotation is not inspect.Parameter.empty for p in params.values())


def test_groups_reach_the_strategy():
    strategy = MCoreRLStrategy(
        ddp=MegatronDDPConfig(use_distributed_optimizer=True),
        reliability=ReliabilityConfig(timedelta(seconds=7), "raise", 3, "gloo"),
        logprobs=LogprobKernelConfig(use_fused_linear_logprobs=True, logprob_chunk_size=16),
    )
    assert strategy.use_distributed_optimizer and strategy.use_fused_linear_logprobs
    assert strategy.policy_config().logprob_chunk_size == 16
    assert (strategy.nonfinite_guard.policy, strategy.nonfinite_guard.max_consecutive_skips) == (
        "raise",
        3,
    )
    assert strategy._timeout == timedelta(seconds=7)
    assert strategy._process_group_backend == "gloo"
    default = MCoreRLStrategy()
    assert not default.use_distributed_optimizer and not default.use_fused_linear_logprobs
    assert default.reliability == ReliabilityConfig() and default._timeout == timedelta(minutes=30)
    assert default.nonfinite_guard.policy == "skip"


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (
            lambda: MegatronDDPConfig(use_distributed_optimizer="yes"),
            TypeError,
            r"`MegatronDDPConfig.use_distributed_optimizer` must be a bool, got str",
        ),
        (
            lambda: ReliabilityConfig(timeout=30),
            TypeError,
            r"`ReliabilityConfig.timeout` must be a datetime.timedelta or None, got int",
        ),
        (
            lambda: ReliabilityConfig(timeout=timedelta(0)),
            ValueError,
            r"`ReliabilityConfig.timeout` must be positive, got 0:00:00",
        ),
        (
            lambda: ReliabilityConfig(nonfinite="ignore"),
            ValueError,
            r"`nonfinite` must be one of \['skip', 'raise'\], got 'ignore'",
        ),
        (
            lambda: ReliabilityConfig(max_consecutive_skips=0),
            ValueError,
            "`max_consecutive_skips` must be >= 1, got 0",
        ),
        (
            lambda: ReliabilityConfig(max_consecutive_skips=True),
            TypeError,
            "`max_consecutive_skips` must be an int, got bool",
        ),
        (
            lambda: ReliabilityConfig(process_group_backend=1),
            TypeError,
            r"`ReliabilityConfig.process_group_backend` must be a str \('nccl', 'gloo'\) or None",
        ),
        (
            lambda: LogprobKernelConfig(use_fused_linear_logprobs=1),
            TypeError,
            "`LogprobKernelConfig.use_fused_linear_logprobs` must be a bool, got int",
        ),
        (
            lambda: LogprobKernelConfig(logprob_chunk_size=0),
            ValueError,
            "`LogprobKernelConfig.logprob_chunk_size` must be a positive int or None, got 0",
        ),
        (
            lambda: LogprobKernelConfig(fused_gradient_in_forward=True),
            ValueError,
            r"`LogprobKernelConfig.fused_gradient_in_forward=True` needs "
            r"`use_fused_linear_logprobs=True`",
        ),
        (
            lambda: LogprobKernelConfig(
                use_fused_linear_logprobs=True, fused_gradient_in_forward=1
            ),
            TypeError,
            "`LogprobKernelConfig.fused_gradient_in_forward` must be a bool, got int",
        ),
        (
            lambda: MCoreRLStrategy(logprobs={}),
            TypeError,
            "`logprobs` must be a LogprobKernelConfig or None, got dict",
        ),
        (
            lambda: MCoreRLStrategy(checkpoint="atomic"),
            TypeError,
            "`checkpoint` must be a CheckpointConfig or None, got str",
        ),
    ],
)
def test_each_group_validates_its_fields(build, error, match):
    with pytest.raises(error, match=match):
        build()


def _configuration(strategy: MCoreRLStrategy) -> tuple:
    """Everything the constructor's arguments set, comparable with `==`."""
    guard = strategy.nonfinite_guard
    return (
        strategy.parallel,
        strategy.microbatching,
        strategy.ddp_config,
        strategy.checkpoint_config,
        strategy.reliability,
        strategy.logprobs,
        strategy.policy_config(),
        strategy.use_distributed_optimizer,
        strategy.use_fused_linear_logprobs,
        (guard.policy, guard.max_consecutive_skips),
        (strategy._timeout, strategy._process_group_backend),
    )


_EVERY_FLAT = {
    "micro_batch_size": 1,
    "max_tokens_per_microbatch": 64,
    "sequence_packing": True,
    "use_distributed_optimizer": True,
    "timeout": timedelta(seconds=90),
    "nonfinite": "raise",
    "max_consecutive_skips": 3,
    "process_group_backend": "gloo",
    "use_fused_linear_logprobs": True,
    "logprob_chunk_size": 16,
}


@pytest.mark.parametrize(
    ("flat", "grouped"),
    [
        ({"micro_batch_size": 4}, {"microbatching": MicrobatchConfig(micro_batch_size=4)}),
        (
            {"micro_batch_size": 2, "sequence_packing": True},
            {"microbatching": MicrobatchConfig(micro_batch_size=2, sequence_packing=True)},
        ),
        ({"use_distributed_optimizer": True}, {"ddp": MegatronDDPConfig(True)}),
        (
            {"timeout": timedelta(seconds=90), "nonfinite": "raise"},
            {"reliability": ReliabilityConfig(timeout=timedelta(seconds=90), nonfinite="raise")},
        ),
        (
            {"max_consecutive_skips": 3, "process_group_backend": "gloo"},
            {
                "reliability": ReliabilityConfig(
                    max_consecutive_skips=3, process_group_backend="gloo"
                )
            },
        ),
        (
            {"use_fused_linear_logprobs": True, "logprob_chunk_size": 16},
            {
                "logprobs": LogprobKernelConfig(
                    use_fused_linear_logprobs=True, logprob_chunk_size=16
                )
            },
        ),
        (
            _EVERY_FLAT,
            {
                "microbatching": MicrobatchConfig(
                    micro_batch_size=1, max_tokens_per_microbatch=64, sequence_packing=True
                ),
                "ddp": MegatronDDPConfig(use_distributed_optimizer=True),
                "reliability": ReliabilityConfig(
                    timeout=timedelta(seconds=90),
                    nonfinite="raise",
                    max_consecutive_skips=3,
                    process_group_backend="gloo",
                ),
                "logprobs": LogprobKernelConfig(
                    use_fused_linear_logprobs=True, logprob_chunk_size=16
                ),
            },
        ),
    ],
)
def test_the_deprecated_flat_spelling_warns_once_and_builds_the_grouped_strategy(flat, grouped):
    with pytest.warns(FutureWarning) as record:
        deprecated = MCoreRLStrategy(pipeline_model_parallel_size=2, **flat)
    warned = [w for w in record if issubclass(w.category, FutureWarning)]
    assert len(warned) == 1, [str(w.message) for w in warned]  # once per construction
    assert warned[0].filename == __file__  # points at the caller
    message = str(warned[0].message)
    assert "deprecated" in message
    for name, value in flat.items():
        group = FLAT_ARGUMENTS[name]
        config = type(grouped[group]).__name__
        assert f"{name}={value!r} -> {group}={config}({name}={value!r})" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the grouped spelling does not warn
        current = MCoreRLStrategy(pipeline_model_parallel_size=2, **grouped)
    assert _configuration(deprecated) == _configuration(current)
    assert _configuration(current) != _configuration(
        MCoreRLStrategy(pipeline_model_parallel_size=2)
    )


def test_the_flat_argument_warning_names_the_grouped_spelling():
    assert flat_argument_warning({"micro_batch_size": 4}) == (
        "MCoreRLStrategy's flat arguments are deprecated and will be removed; pass their groups "
        "instead (one config per group): micro_batch_size=4 -> "
        "microbatching=MicrobatchConfig(micro_batch_size=4)."
    )
    assert set(FLAT_ARGUMENTS) == set(_EVERY_FLAT)


def test_a_flat_argument_with_its_group_or_a_cluster_environment_raises():
    with (
        pytest.warns(FutureWarning, match="deprecated"),
        pytest.raises(TypeError, match=r"both `logprobs=` and `use_fused_linear_logprobs=`"),
    ):
        MCoreRLStrategy(logprobs=LogprobKernelConfig(), use_fused_linear_logprobs=True)
    with pytest.raises(TypeError, match=r"no `cluster_environment`.*Trainer\(plugins="):
        MCoreRLStrategy(cluster_environment=None)
    with (
        pytest.warns(FutureWarning, match="max_consecutive_skips=0 -> reliability="),
        pytest.raises(ValueError, match=r"`max_consecutive_skips` must be >= 1"),
    ):
        MCoreRLStrategy(max_consecutive_skips=0)  # the group's own validation applies


@pytest.mark.parametrize(
    ("precision", "in_fp32"), [("32-true", True), ("bf16-mixed", True), ("bf16-true", False)]
)
def test_ddp_config_grad_reduce_dtype_follows_precision(precision, in_fp32):
    config = MegatronDDPConfig(use_distributed_optimizer=True).to_megatron(precision=precision)
    assert config.grad_reduce_in_fp32 is in_fp32
    assert config.use_distributed_optimizer is True


def test_trainer_flags_map_clip_and_reject_accumulation_and_value_clipping():
    assert check_trainer_flags(1, None, None) == 0.0  # explicit: no clipping (megatron default 1.0)
    assert check_trainer_flags(1, 0.5, "norm") == 0.5
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=4\)` is not supported"):
        check_trainer_flags(4, None, None)
    with pytest.raises(ValueError, match="megatron clips by the global gradient norm"):
        check_trainer_flags(1, 0.5, "value")


def test_precision_translation():
    assert to_mcore_precision(Precision()).precision == "32-true"
    assert to_mcore_precision(MixedPrecision("bf16-mixed", "cpu")).precision == "bf16-mixed"
    assert MCorePrecision("bf16-true").params_dtype is torch.bfloat16
    with pytest.raises(ValueError, match=r"got '64-true' \(DoublePrecision\)"):
        to_mcore_precision(DoublePrecision())
    with pytest.raises(ValueError, match="fp16 with loss scaling and fp8 are not supported"):
        MCorePrecision("16-mixed")  # type: ignore[arg-type]


def test_trainer_precision_flag_reaches_the_strategy_and_bad_flags_raise():
    strategy = MCoreRLStrategy()
    assert strategy.precision_plugin.precision == "32-true"  # lazy default
    Trainer(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed", logger=False)
    assert strategy.precision_plugin.precision == "bf16-mixed"  # not silently ignored
    with pytest.raises(ValueError, match="MCoreRLStrategy supports precision"):
        Trainer(accelerator="cpu", devices=1, strategy=MCoreRLStrategy(), precision="64-true")


def test_importing_the_package_registers_mcore_rl():
    assert lightning_mcore_rl.MCoreRLStrategy is MCoreRLStrategy
    assert "mcore_rl" in StrategyRegistry
    trainer = Trainer(accelerator="cpu", devices=1, strategy="mcore_rl", logger=False)
    assert isinstance(trainer.strategy, MCoreRLStrategy)


def test_transformer_config_kwargs_follow_strategy_and_precision():
    strategy = MCoreRLStrategy(
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=2,
    )
    strategy.precision_plugin = MixedPrecision("bf16-mixed", "cpu")
    kwargs = strategy.transformer_config_kwargs()
    assert kwargs["tensor_model_parallel_size"] == 2 and kwargs["bf16"] is True
    assert (kwargs["expert_model_parallel_size"], kwargs["expert_tensor_parallel_size"]) == (1, 2)
    assert kwargs["params_dtype"] is torch.bfloat16
    assert kwargs["batch_p2p_comm"] is False  # the VPP p2p trap
    assert strategy.vp_stages == [0, 1]


def test_split_lm_batch():
    batch = {"tokens": torch.arange(12).view(6, 2), "labels": torch.arange(12).view(6, 2)}
    parts = split_lm_batch(batch, Microbatching(micro_batch_size=2))
    assert len(parts) == 3 and torch.equal(parts[1]["tokens"], batch["tokens"][2:4])
    with pytest.raises(ValueError, match="6 samples, not divisible by micro_batch_size=4"):
        split_lm_batch(batch, Microbatching(micro_batch_size=4))
    with pytest.raises(ValueError, match="dim 0"):
        split_lm_batch({"tokens": torch.zeros(2, 1), "labels": torch.zeros(3, 1)}, Microbatching())
    with pytest.raises(ValueError, match="needs the `MCoreRLModule\\(loss_fn=...\\)` path"):
        split_lm_batch(batch, Microbatching(max_tokens_per_microbatch=8))
