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
    """At the end of ``fit``, write the policy of a module whose ``policy.hf_bridge()`` gives its
    :class:`~lightning_mcore_rl.models.HFBridge` (a recipe module built from an
    :class:`~lightning_mcore_rl.recipes.HFModelSpec`) to ``out_dir`` with
    :meth:`HFBridge.save_pretrained <lightning_mcore_rl.models.HFBridge.save_pretrained>`: the
    source directory's ``config.json`` and tokenizer files, and the weights gathered over
    TP/PP/VPP (global rank 0 writes; every rank takes part).

    The hook is ``on_train_end``: Lightning calls it on every rank when the fit loop finishes,
    while the strategy still holds the model chunks and its CPU backend (``on_fit_end`` runs
    after the strategy's teardown), and not when training raised.

    Args:
        out_dir: a new or empty directory.
        dtype: the weights' dtype (default: each tensor's dtype in the source checkpoint).

    A module whose model is not a causal LM (its LM head replaced, e.g. a reward model's score
    head) declares ``causal_lm = False`` and is refused.

    Raises:
        TypeError: (at ``setup``) the module has no Hugging Face bridge (``policy.hf_bridge()``
            of an ``HFModelSpec`` recipe) or declares ``causal_lm = False``.
        FileExistsError: (at the end of training) ``out_dir`` already holds weights.
    """

    def __init__(self, out_dir: str | os.PathLike[str], dtype: torch.dtype | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.dtype = dtype

    @staticmethod
    def bridge(pl_module: LightningModule) -> HFBridge:
        """The module's :class:`~lightning_mcore_rl.models.HFBridge` (its ``policy``'s).

        Raises:
            TypeError: the module has no ``policy.hf_bridge()``, its model is not an HF one, or
                it declares ``causal_lm = False`` (e.g. a reward model: its score head has no
                causal-LM counterpart).
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
        """Collective: gather and write the trained weights to ``out_dir``."""
        from lightning_mcore_rl.module import MCoreRLModule

        assert isinstance(pl_module, MCoreRLModule)  # RecipeModel modules are MCoreRLModules
        chunks = pl_module.mcore_strategy.model_chunks
        self.bridge(pl_module).save_pretrained(
            chunks, self.out_dir, groups=pl_module.parallel_groups, dtype=self.dtype
        )
