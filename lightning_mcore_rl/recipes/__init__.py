"""Ready-made LightningModules (Lightning-integration layer) built from the RL recipe pieces."""

from lightning_mcore_rl.recipes.grpo import (
    GRPOModule,
    HFModelSpec,
    PromptDataModule,
    PromptDataset,
    RolloutSpec,
    TinyGPTSpec,
)

__all__ = [
    "GRPOModule",
    "HFModelSpec",
    "PromptDataModule",
    "PromptDataset",
    "RolloutSpec",
    "TinyGPTSpec",
]
