"""``lmrl``'s errors a user reads: one line ``lmrl: error: ...`` and exit 2 for a bad option or
value (the full chain under ``LMRL_ALL_TRACEBACKS=1``), the nested spelling of a flat strategy
argument, and ``lmrl validate``/``test`` refusing to evaluate nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from lightning.pytorch import LightningDataModule, LightningModule

import lightning_mcore_rl.cli as cli_module
from lightning_mcore_rl.cli import ConfigError, NoEvaluationDataError, build_cli, condense

ROOT = Path(__file__).parents[3]
GRPO_TINY = [
    f"--config={ROOT / 'examples' / 'configs' / 'grpo_tiny.yaml'}",
    "--trainer.devices=1",
    "--trainer.strategy.init_args.tensor_model_parallel_size=1",
    "--trainer.logger=false",
    "--trainer.callbacks=[]",
]
BORING = [
    "--model=lightning.pytorch.demos.boring_classes.BoringModel",
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


class NoValidationData(LightningModule):
    """A module whose ``val_dataloader`` is empty (as the prompt data without ``val_files``)."""

    def validation_step(self, batch: object, batch_idx: int) -> None:
        raise AssertionError("there is no batch to validate")

    def val_dataloader(self) -> list[object]:
        return []


class NoValFiles(LightningDataModule):
    """A data module without held-out files (as ``PromptFileDataModule(val_files=None)``)."""

    val_files = None

    def val_dataloader(self) -> list[object]:
        return []


def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("lmrl:")]


@pytest.fixture(autouse=True)
def _no_process_group_left() -> Iterator[None]:
    """A refusal in the run's set-up leaves the run's process group and megatron state behind
    (Lightning destroys neither at teardown); later tests of this process need none."""
    yield
    if dist.is_initialized():
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        # a value the project's class refuses when built (2-3 chained tracebacks before)
        ("--model.init_args.rollout.max_staleness=-1", "`max_staleness` must be >= 0, got -1"),
        # values and names jsonargparse refuses while parsing (50 lines of usage before)
        ("--trainer.max_steps=abc", "trainer.max_steps: Expected a <class 'int'>. Got value: abc"),
        ("--model.init_args.rollout.bogus=1", "model.rollout: Option 'bogus' is not accepted"),
        ("--nonsense=1", "unrecognized arguments: --nonsense=1"),
        ("--model.init_args.rollout.temperature=0", "`temperature` must be > 0, got 0.0"),
        ("--model.init_args.rollout.top_p=1.5", "`top_p` must be in (0, 1], got 1.5"),
        ("--model.init_args.loss.ratio_clip_min=-0.5", "`ratio_clip_min` must be >= 0, got -0.5."),
        ("--model.init_args.task.modulus=1", "`modulus` must be in [2, vocab_size=16], got 1"),
        ("--data.init_args.prompts_per_step=0", "`prompts_per_step` must be >= 1, got 0"),
        # a strategy value: jsonargparse's innermost error only said "Expected a <class 'str'>"
        (
            "--trainer.strategy.init_args.microbatching.micro_batch_size=0",
            "`micro_batch_size` must be a positive int, got 0.",
        ),
        (
            "--trainer.strategy.init_args.pipeline_model_parallel_size=0",
            "`pipeline_model_parallel_size` must be a positive int, got 0.",
        ),
        # refused by the run's set-up checks, before any collective (a traceback before)
        ("--model.init_args.pass_at_k=[9]", "pass@k needs 1 <= k <= n (the group size 4), got k=9"),
        (
            "--trainer.gradient_clip_val=-1",
            "`Trainer(gradient_clip_val=-1)` must be a finite number >= 0 (0 or None: no clipping).",
        ),
    ],
)
def test_a_bad_override_prints_one_line_and_exits_2(
    override, message, capsys, monkeypatch, tmp_path
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LMRL_ALL_TRACEBACKS", raising=False)
    assert cli_module.main(["fit", *GRPO_TINY, override]) == 2
    assert _error_lines(capsys.readouterr().err) == [f"lmrl: error: {message}"]


def test_all_tracebacks_raises_the_error_with_its_chain(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LMRL_ALL_TRACEBACKS", "1")
    with pytest.raises(ConfigError, match=r"^`max_staleness` must be >= 0, got -1$") as info:
        cli_module.main(["fit", *GRPO_TINY, "--model.init_args.rollout.max_staleness=-1"])
    causes = []
    error: BaseException | None = info.value
    while error is not None:
        causes.append(error)
        error = error.__cause__ or error.__context__
    assert len(causes) >= 3  # jsonargparse's union errors wrapping the recipe's ValueError
    assert "Does not validate against any of the Union subtypes" in str(causes[1])


NESTED = (
    "MCoreRLStrategy takes `micro_batch_size` nested in `microbatching`: in YAML `init_args: "
    "{microbatching: {micro_batch_size: ...}}`, on the command line "
    "`--trainer.strategy.microbatching.micro_batch_size=...`"
)


def test_a_flat_strategy_argument_on_the_command_line_names_the_nested_spelling(
    capsys, monkeypatch, tmp_path
):
    monkeypatch.chdir(tmp_path)
    override = "--trainer.strategy.init_args.micro_batch_size=2"
    assert cli_module.main(["fit", *GRPO_TINY, override]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert line == (
        "lmrl: error: trainer.strategy: Option 'micro_batch_size' is not accepted — " + NESTED
    )


def test_a_flat_strategy_argument_in_yaml_names_the_nested_spelling(tmp_path):
    config = tmp_path / "flat.yaml"
    config.write_text(
        """
trainer:
  strategy:
    class_path: lightning_mcore_rl.MCoreRLStrategy
    init_args:
      tensor_model_parallel_size: 1
      micro_batch_size: 2
"""
    )
    with pytest.raises(ConfigError) as info:
        build_cli([*BORING, f"--config={config}"], run=False)
    assert str(info.value).endswith("Option 'micro_batch_size' is not accepted — " + NESTED)


def test_condense_keeps_the_key_path_and_the_innermost_messages():
    message = """Parser key "model":
  Does not validate against any of the Union subtypes
  Subtypes: [<class 'LightningModule'>, <class 'NoneType'>]
  Errors:
    - Problem with given class_path 'x.GRPOModule':
        Parser key "rollout":
          Errors:
            - Problem with given class_path 'x.RolloutSpec':
                Option 'bogus' is not accepted
            - Expected a <class 'NoneType'>
    - Expected a <class 'NoneType'>
  Given value type: <class 'jsonargparse._util.NestedArg'>"""
    assert condense(message) == "model.rollout: Option 'bogus' is not accepted"


def test_validate_without_validation_data_says_so_and_exits_2(capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    module = f"--model={__name__}.NoValidationData"
    assert cli_module.main(["validate", *BORING, module]) == 2
    (line,) = _error_lines(capsys.readouterr().err)
    assert line.startswith(
        "lmrl: error: `lmrl validate` found no validation data: NoValidationData's "
        "`val_dataloader` gave no batch"
    )
    assert line.endswith("nothing was evaluated.")


def test_validate_names_the_data_modules_setting(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NoEvaluationDataError) as info:
        build_cli(["validate", *BORING, f"--data={__name__}.NoValFiles"])
    assert str(info.value).startswith(
        "`lmrl validate` found no validation data: NoValFiles's `val_dataloader` gave no batch "
        "(set its `val_files`), or `--trainer.limit_val_batches` is 0"
    )


def test_validate_with_no_batch_allowed_raises(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NoEvaluationDataError, match=r"`--trainer.limit_val_batches` is 0"):
        build_cli(["validate", *BORING, "--trainer.limit_val_batches=0"])


def test_validate_with_data_still_runs(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cli = build_cli(["validate", *BORING, "--trainer.limit_val_batches=2"])
    assert cli.trainer.validate_loop.max_batches == [2]


def test_a_bug_keeps_its_traceback(monkeypatch, tmp_path):
    """An error that is not a configuration mistake is not condensed into a line."""
    monkeypatch.chdir(tmp_path)

    def broken(self: object) -> None:
        raise AttributeError("a bug")

    monkeypatch.setattr(
        "lightning.pytorch.cli.LightningCLI.instantiate_trainer", broken, raising=True
    )
    with pytest.raises(AttributeError, match="a bug"):
        cli_module.main(["fit", *BORING])
