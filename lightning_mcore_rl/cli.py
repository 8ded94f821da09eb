"""``lmrl``: LightningCLI for lightning-mcore-rl (``lmrl fit --config x.yaml``).

Importing :mod:`lightning_mcore_rl` registers the strategy name ``"mcore_rl"``, so a config may
say ``trainer.strategy: mcore_rl`` or give ``class_path: lightning_mcore_rl.MCoreRLStrategy``
with ``init_args`` (parallel sizes, ``ddp``, ``checkpoint``).
"""

from __future__ import annotations

from lightning.pytorch import LightningModule
from lightning.pytorch.cli import ArgsType, LightningCLI

import lightning_mcore_rl  # noqa: F401 - registers "mcore_rl"


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """The CLI object (``run=False``: parse and instantiate only, for tests and notebooks)."""
    return LightningCLI(
        LightningModule,
        subclass_mode_model=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def main(args: ArgsType = None) -> None:
    """Console entry point ``lmrl``."""
    build_cli(args)


if __name__ == "__main__":
    main()
