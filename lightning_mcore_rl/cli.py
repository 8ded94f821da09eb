"""``lmrl``: LightningCLI for lightning-mcore-rl (``lmrl fit --config x.yaml``).

Subcommands: Lightning's ``fit``/``validate``/``test``/``predict``, and ``export``, which converts
a training checkpoint into a Hugging Face directory (``lmrl export --ckpt DIR --hf-source HF_DIR
--out OUT``, see :mod:`lightning_mcore_rl.strategy.export`; ``lmrl export --help``).

Choosing the strategy (importing :mod:`lightning_mcore_rl` registers the name ``"mcore_rl"``):

* ``--trainer.strategy=mcore_rl`` (or ``strategy: mcore_rl`` in YAML): the registry name, a plain
  string to Lightning, so it takes **no** init args (every setting at its default);
* ``--trainer.strategy=lightning_mcore_rl.MCoreRLStrategy`` or the short class name
  ``--trainer.strategy=MCoreRLStrategy``, followed by init args such as
  ``--trainer.strategy.tensor_model_parallel_size=2``;
* in YAML, ``class_path: lightning_mcore_rl.MCoreRLStrategy`` with ``init_args`` (parallel sizes,
  nested ``microbatching``/``ddp``/``checkpoint`` configs).

Optimizers come from the module's ``configure_optimizers`` (a megatron ``OptimizerConfig``), so
LightningCLI's ``--optimizer``/``--lr_scheduler`` arguments are not offered.

An error raised on every rank prints one traceback, rank 0's; the other ranks print one line
each (:mod:`lightning_mcore_rl.rank_errors`; ``LMRL_ALL_TRACEBACKS=1`` prints every rank's).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lightning.pytorch import LightningModule
from lightning.pytorch.cli import ArgsType, LightningCLI

import lightning_mcore_rl  # noqa: F401 - registers "mcore_rl"
from lightning_mcore_rl._compat import filter_expected_warnings
from lightning_mcore_rl.rank_errors import install_rank_excepthook

DESCRIPTION = (
    "lightning-mcore-rl: megatron-core RL training under PyTorch Lightning. "
    "`lmrl export --help`: convert a training checkpoint into a Hugging Face directory."
)


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """The CLI object (``run=False``: parse and instantiate only, for tests and notebooks)."""
    return LightningCLI(
        LightningModule,
        subclass_mode_model=True,
        save_config_kwargs={"overwrite": True},
        # megatron optimizers come from `configure_optimizers`: no --optimizer/--lr_scheduler
        auto_configure_optimizers=False,
        parser_kwargs={"description": DESCRIPTION},
        args=args,
        run=run,
    )


def main(args: ArgsType = None) -> int | None:
    """Console entry point ``lmrl``: ``lmrl export ...`` runs
    :func:`lightning_mcore_rl.strategy.export.main`, anything else goes to LightningCLI.

    Returns the export's exit status (``None`` after a LightningCLI run). An uncaught error
    prints its traceback on rank 0 only (:func:`~.rank_errors.install_rank_excepthook`).
    """
    filter_expected_warnings()
    install_rank_excepthook()
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, Sequence) and not isinstance(argv, str) and argv and argv[0] == "export":
        from lightning_mcore_rl.strategy.export import main as export_main

        return export_main(list(argv[1:]))
    build_cli(args)
    return None


if __name__ == "__main__":
    sys.exit(main())
