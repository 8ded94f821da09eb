"""Ready-made LightningModules (Lightning-integration layer) built from the RL recipe pieces."""

from lightning_mcore_rl.recipes.grpo import (
    GRPOModule,
    PromptDataModule,
    PromptDataset,
    RolloutSpec,
    TinyGPTSpec,
)

__all__ = ["GRPOModule", "PromptDataModule", "PromptDataset", "RolloutSpec", "TinyGPTSpec"]
