"""`lmrl`: LightningCLI for lightning-mcore-rl (`lmrl fit --config x.yaml`): Lightning's
`fit`/`validate`/`test`/`predict`, and `export` (a training checkpoint to a Hugging Face
directory, `strategy/export.py`)."""

# The strategy: `--trainer.strategy=mcore_rl` (the registry name: a plain string to Lightning, so
# NO init args), or `--trainer.strategy=MCoreRLStrategy` (or `lightning_mcore_rl.MCoreRLStrategy`,
# or `class_path:` in YAML) followed by init args such as
# `--trainer.strategy.tensor_model_parallel_size=2` and the nested config groups. Optimizers come
# from the module's `configure_optimizers` (a megatron `OptimizerConfig`), so LightningCLI's
# `--optimizer`/`--lr_scheduler` are not offered. An error raised on every rank prints one
# traceback, rank 0's (rank_errors.py; `LMRL_ALL_TRACEBACKS=1`: every rank's). A bad
# configuration prints one line, `lmrl: error: <message>`, and exits 2 (`ConfigError`;
# `LMRL_ALL_TRACEBACKS=1` raises it with jsonargparse's chain); `lmrl validate`/`test` with no
# batch to evaluate is an error too.

from __future__ import annotations

import os
import re
import sys
from argparse import ArgumentError
from collections.abc import Sequence
from pathlib import Path

from lightning.pytorch import LightningModule
from lightning.pytorch.cli import ArgsType, LightningCLI

import lightning_mcore_rl  # noqa: F401 - registers "mcore_rl"
from lightning_mcore_rl._compat import filter_expected_warnings
from lightning_mcore_rl.rank_errors import (
    ALL_TRACEBACKS_ENV,
    current_rank,
    install_rank_excepthook,
)
from lightning_mcore_rl.strategy.config import FLAT_ARGUMENTS

DESCRIPTION = (
    "lightning-mcore-rl: megatron-core RL training under PyTorch Lightning. "
    "`lmrl export --help`: convert a training checkpoint into a Hugging Face directory. "
    f"A bad option prints one line ({ALL_TRACEBACKS_ENV}=1: the full traceback)."
)

CONFIG_ERROR_EXIT = 2
"""``lmrl``'s exit status for a :class:`ConfigError` (argparse's for a usage error)."""

PACKAGE_DIR = str(Path(lightning_mcore_rl.__file__).resolve().parent) + os.sep

# The innermost error of these kinds is a configuration mistake (a value a class refuses, a
# missing file or package); any other kind is a bug and keeps its traceback.
_CONFIG_ERROR_KINDS = (ValueError, TypeError, ImportError, OSError, ArgumentError, KeyError)

# jsonargparse's nesting lines, which say where but not what is wrong.
_NOISE = re.compile(
    r"^(Does not validate against any of the Union subtypes|Subtypes:|Errors:|Given value"
    r"|Expected a <class 'NoneType'>)"
)
_PARSER_KEY = re.compile(r'^Parser key "([^"]+)":?\s*(.*)$')
_CLASS_PATH = re.compile(r"^Problem with given class_path '[^']+':?\s*(.*)$")
_NOT_ACCEPTED = re.compile(r"Option '(\w+)' is not accepted")
_BARE_TYPE = re.compile(r"^Expected a <class '[^']+'>$")
_UNION_MISS = re.compile(r"^(\S+: )?Expected a <class '[^']+'>(\. Got value: .*)?$")


class ConfigError(ValueError):
    """A bad `lmrl` configuration: its message is the one line `lmrl` prints, the errors it
    condenses are its `__cause__`."""


class NoEvaluationDataError(ConfigError):
    """``lmrl validate``/``lmrl test`` evaluated no batch (no data, or a limit of 0)."""


def condense(message: str) -> str:
    """One line from a jsonargparse error: the dotted key path (`model.rollout.backend`), then
    the distinct messages of its innermost lines (a flat strategy option: its nested spelling)."""
    keys: list[str] = []
    details: list[str] = []
    for raw in message.splitlines():
        line = raw.strip().removeprefix("- ").strip()
        while line:
            if (match := _PARSER_KEY.match(line)) is not None:
                keys.append(match.group(1))
                line = match.group(2)
            elif (match := _CLASS_PATH.match(line)) is not None:
                line = match.group(1)
            else:
                break
        if line and not _NOISE.match(line) and line not in details:
            details.append(line)
    if len(details) > 1:  # a bare type mismatch is another union member's, not the mistake
        details = [d for d in details if not _BARE_TYPE.match(d)] or details
    where = ".".join(keys)
    text = "; ".join(details) or message.strip()
    hint = _nesting_hint(where, text)
    return f"{where}: {text}{hint}" if where else f"{text}{hint}"


def _nesting_hint(where: str, text: str) -> str:
    """The nested spelling of a flat ``MCoreRLStrategy`` argument rejected at ``where``."""
    match = _NOT_ACCEPTED.search(text)
    if match is None or "strategy" not in where or match.group(1) not in FLAT_ARGUMENTS:
        return ""
    name = match.group(1)
    group = FLAT_ARGUMENTS[name]
    return (
        f" — MCoreRLStrategy takes `{name}` nested in `{group}`: in YAML `init_args: "
        f"{{{group}: {{{name}: ...}}}}`, on the command line "
        f"`--trainer.strategy.{group}.{name}=...`"
    )


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and its causes (or contexts), outermost first."""
    chain: list[BaseException] = []
    current: BaseException | None = error
    while current is not None and all(current is not seen for seen in chain):
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _raised_in_project(error: BaseException) -> bool:
    """Whether ``error`` was raised by this package's code (its innermost frame is ours)."""
    traceback = error.__traceback__
    if traceback is None:
        return False
    while traceback.tb_next is not None:
        traceback = traceback.tb_next
    return traceback.tb_frame.f_code.co_filename.startswith(PACKAGE_DIR)


def config_error(error: BaseException) -> ConfigError | None:
    """The `ConfigError` for a failed parse or instantiation (the innermost message this package
    raised, else the innermost one, condensed), or `None` for a bug (keep its traceback)."""
    chain = _chain(error)
    ours = [e for e in chain if _raised_in_project(e)]
    cause = ours[-1] if ours else chain[-1]
    if not isinstance(cause, _CONFIG_ERROR_KINDS):
        return None
    if ours:  # the project's messages are written for the user
        return ConfigError(str(cause).strip() or type(cause).__name__)
    # jsonargparse's nest every union member tried; the innermost can be the one that only says
    # a value is not a str (`trainer.strategy`), while the class's own refusal sits one level out
    condensed = [condense(str(e)) for e in chain if isinstance(e, _CONFIG_ERROR_KINDS)]
    telling = [c for c in condensed if not _UNION_MISS.match(c)]
    return ConfigError((telling or condensed)[-1])


class LmrlCLI(LightningCLI):
    """LightningCLI whose instantiation errors raise one `ConfigError` (parse errors:
    `build_cli`), and whose `validate`/`test` refuse to evaluate nothing."""

    def instantiate_classes(self) -> None:
        """Build the model, data and trainer as LightningCLI does.

        Raises:
            ConfigError: a class refused its arguments (the innermost message).
        """
        try:
            super().instantiate_classes()
        except Exception as error:
            wrapped = config_error(error)
            if wrapped is None:
                raise
            raise wrapped from error

    def after_validate(self) -> None:
        """Raises :class:`NoEvaluationDataError` when ``validate`` evaluated no batch."""
        self._check_evaluated("validate", "validation", self.trainer.validate_loop.max_batches)

    def after_test(self) -> None:
        """Raises :class:`NoEvaluationDataError` when ``test`` evaluated no batch."""
        self._check_evaluated("test", "test", self.trainer.test_loop.max_batches)

    def _check_evaluated(self, subcommand: str, kind: str, batches: Sequence[float]) -> None:
        # Lightning skips an evaluation without batches silently (exit 0, no output)
        if sum(batches) > 0:
            return
        short = "val" if kind == "validation" else "test"
        source = self.datamodule if self.datamodule is not None else self.model
        # the recipes' data modules: `val_files` (prompt/response files), `val_prompts` (toy)
        knob = next((n for n in (f"{short}_files", f"{short}_prompts") if hasattr(source, n)), "")
        raise NoEvaluationDataError(
            f"`lmrl {subcommand}` found no {kind} data: {type(source).__name__}'s "
            f"`{short}_dataloader` gave no batch{f' (set its `{knob}`)' if knob else ''}, or "
            f"`--trainer.limit_{short}_batches` is 0; nothing was evaluated."
        )


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """The CLI object (`run=False`: parse and instantiate only, for tests and notebooks).

    Raises:
        ConfigError: a bad option or value, or one the run's set-up refuses.
    """
    try:
        return LmrlCLI(
            LightningModule,
            subclass_mode_model=True,
            save_config_kwargs={"overwrite": True},
            # megatron optimizers come from `configure_optimizers`: no --optimizer/--lr_scheduler
            auto_configure_optimizers=False,
            # parse errors raise (ConfigError, one line) instead of printing 50 lines of usage
            parser_kwargs={"description": DESCRIPTION, "exit_on_error": False},
            args=args,
            run=run,
        )
    except ArgumentError as error:  # the options, the config files or a checkpoint's hparams
        raise ConfigError(condense(str(error))) from error
    except ConfigError:
        raise
    except (ValueError, TypeError) as error:  # the run's set-up checks (before any collective)
        ours = [e for e in _chain(error) if _raised_in_project(e)]
        if not ours or not isinstance(ours[-1], (ValueError, TypeError)):
            raise  # not the project's refusal: a bug or a library's error keeps its traceback
        raise ConfigError(str(ours[-1]).strip() or type(ours[-1]).__name__) from error


def main(args: ArgsType = None) -> int | None:
    """Console entry point `lmrl`: `lmrl export ...` runs `strategy.export.main`, anything else
    LightningCLI; returns the export's status, `2` after a `ConfigError`, else `None`."""
    # a ConfigError prints one line on rank 0 (its chain under LMRL_ALL_TRACEBACKS=1); any
    # other uncaught error prints its traceback on rank 0 only (install_rank_excepthook)
    filter_expected_warnings()
    install_rank_excepthook()
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, Sequence) and not isinstance(argv, str) and argv and argv[0] == "export":
        from lightning_mcore_rl.strategy.export import main as export_main

        return export_main(list(argv[1:]))
    try:
        build_cli(args)
    except ConfigError as error:
        if os.environ.get(ALL_TRACEBACKS_ENV) == "1":
            raise
        if current_rank() == 0:  # every rank of a launched run raises it: one line per run
            print(f"lmrl: error: {error}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT
    return None


if __name__ == "__main__":
    sys.exit(main())
