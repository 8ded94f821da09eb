"""``lmrl``'s console entry point: the top-level help in a fraction of a second.

``import lightning_mcore_rl`` imports Lightning (registering the strategy name ``"mcore_rl"`` on
import needs it: public API), which costs seconds, and any module inside the package imports
the package first. So this launcher is a separate top-level module that imports only the
standard library: ``lmrl``, ``lmrl -h`` and ``lmrl --help`` print :func:`help_text`; anything
else (``lmrl fit --help``, ``lmrl fit --config ...``, ``lmrl export ...``) goes to
:func:`lightning_mcore_rl.cli.main`, unchanged.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Sequence

DESCRIPTION = (
    "lightning-mcore-rl: megatron-core RL training under PyTorch Lightning. "
    "`lmrl export --help`: convert a training checkpoint into a Hugging Face directory. "
    "A bad option prints one line (LMRL_ALL_TRACEBACKS=1: the full traceback)."
)
"""The real CLI's description (``lightning_mcore_rl.cli.DESCRIPTION``; a test keeps them equal)."""

LIGHTNING_SUBCOMMANDS: dict[str, str] = {
    "fit": "Runs the full optimization routine.",
    "validate": "Perform one evaluation epoch over the validation set.",
    "test": "Perform one evaluation epoch over the test set.",
    "predict": "Run inference on your data.",
}
"""LightningCLI's subcommands (``LightningCLI.subcommands()``; a test keeps the names equal)."""

SUBCOMMANDS: dict[str, str] = {
    **LIGHTNING_SUBCOMMANDS,
    "export": "Convert a training checkpoint into a Hugging Face directory.",
}
"""Every subcommand ``lmrl`` runs, with its one-line description."""

_HELP_ARGS = ((), ("-h",), ("--help",))


def help_text() -> str:
    """The top-level help: usage, the subcommands and where each one's options are listed."""
    names = ",".join(LIGHTNING_SUBCOMMANDS)
    rows = "\n".join(f"  {name:<10} {text}" for name, text in SUBCOMMANDS.items())
    return (
        f"usage: lmrl [-h] [-c CONFIG] [--print_config[=flags]] {{{names}}} ...\n"
        "       lmrl export --ckpt DIR --hf-source HF_DIR --out OUT\n\n"
        f"{textwrap.fill(DESCRIPTION, 79)}\n\n"
        "subcommands (each one's options: `lmrl SUBCOMMAND --help`, e.g. `lmrl fit --help`):\n"
        f"{rows}\n\n"
        "options:\n"
        "  -h, --help            Show this help message and exit.\n"
        "  -c CONFIG, --config CONFIG\n"
        "                        Path to a configuration file in json or yaml format.\n"
        "  --print_config[=flags]\n"
        "                        Print the configuration after applying all other arguments\n"
        "                        and exit (flags: skip_default, skip_unset).\n\n"
        "example: lmrl fit --config examples/configs/grpo_tiny.yaml --trainer.max_steps=5\n"
    )


def main(argv: Sequence[str] | None = None) -> int | None:
    """Console entry point ``lmrl``: the help (no arguments: on stderr, exit 2, as argparse
    does for a missing subcommand), else :func:`lightning_mcore_rl.cli.main`'s result."""
    args = tuple(sys.argv[1:] if argv is None else argv)
    if args in _HELP_ARGS:
        if args:
            sys.stdout.write(help_text())
            return 0
        sys.stderr.write(help_text())
        sys.stderr.write(f"lmrl: error: a subcommand is required ({', '.join(SUBCOMMANDS)}).\n")
        return 2
    # Only now the package (Lightning, seconds): every other command needs it.
    from lightning_mcore_rl.cli import main as cli_main

    return cli_main(None if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
