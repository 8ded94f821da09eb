"""Write the trained policy as a Hugging Face directory when training ends."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

if TYPE_CHECKING:
    from lightning_mcore_rl.models import HFBridge


class HFExport(Callback):
    """At the end of `fit`, write the policy of a recipe module built from an `HFModelSpec` to
    `out_dir` (`HFBridge.save_pretrained`: weights gathered over TP/PP/VPP; collective).

    Args:
        out_dir: a new or empty directory.
        dtype: the weights' dtype (default: each tensor's dtype in the source checkpoint).

    Raises:
        TypeError: (at `setup`) the module has no `policy.hf_bridge()` or declares
            `causal_lm = False` (e.g. a reward model's score head).
        FileExistsError: (at the end of training) `out_dir` already holds weights.
    """

    def __init__(self, out_dir: str | os.PathLike[str], dtype: torch.dtype | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.dtype = dtype

    @staticmethod
    def bridge(pl_module: LightningModule) -> HFBridge:
        """The module's `HFBridge` (its `policy`'s).

        Raises:
            TypeError: no `policy.hf_bridge()`, not an HF model, or `causal_lm = False`.
        """
        name = type(pl_module).__name__
        if not getattr(pl_module, "causal_lm", True):
            raise TypeError(
                f"HFExport writes causal LMs; a {name}'s LM head is replaced (`causal_lm = "
                "False`, e.g. a reward model's score head), which the Hugging Face checkpoint "
                "has no place for."
            )
        hf_bridge = getattr(getattr(pl_module, "policy", None), "hf_bridge", None)
        if not callable(hf_bridge):
            raise TypeError(
                f"HFExport needs a recipe module with a `policy` (RecipeModel) built from an "
                f"HFModelSpec; {name} has none."
            )
        try:
            bridge = hf_bridge()
        except TypeError as err:
            raise TypeError(
                f"HFExport: {name}'s model has no Hugging Face bridge ({err}); "
                "build it from an HFModelSpec to export it."
            ) from err
        return cast("HFBridge", bridge)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Check the module has an HF bridge before training starts (every rank raises alike)."""
        self.bridge(pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Collective: gather and write the trained weights to `out_dir`."""
        # `on_train_end`, not `on_fit_end`: the strategy still holds the model chunks and its CPU
        # backend (on_fit_end runs after its teardown), and it is not called when training raised
        from lightning_mcore_rl.module import MCoreRLModule

        assert isinstance(pl_module, MCoreRLModule)  # RecipeModel modules are MCoreRLModules
        chunks = pl_module.mcore_strategy.model_chunks
        self.bridge(pl_module).save_pretrained(
            chunks, self.out_dir, groups=pl_module.parallel_groups, dtype=self.dtype
        )
