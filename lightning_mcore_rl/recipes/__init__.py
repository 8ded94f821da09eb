"""Ready-made LightningModules built from the RL recipe pieces: GRPO (RLOO / REINFORCE++), PPO,
SFT, DPO, a reward model and on-policy distillation, and prompt files (``docs/recipes.md``)."""

from lightning_mcore_rl.recipes.arithmetic import (
    ArithmeticProblem,
    evaluate_hf,
    greedy_completions,
    make_splits,
    train_tokenizer,
    write_rl_rows,
    write_sft_rows,
    write_tiny_llama,
    write_tiny_qwen3_moe,
)
from lightning_mcore_rl.recipes.common import HFModelSpec, RecipeModel, TinyGPTSpec
from lightning_mcore_rl.recipes.distillation import DistillationModule, TeacherSpec
from lightning_mcore_rl.recipes.dpo import DPOModule, PreferenceDataModule
from lightning_mcore_rl.recipes.grpo import (
    GRPOModule,
    PromptDataModule,
    PromptDataset,
    RolloutSpec,
)
from lightning_mcore_rl.recipes.ppo import PolicyValueChunk, PPOLossFn, PPOModule
from lightning_mcore_rl.recipes.prompt_data import (
    PromptBatch,
    PromptFileDataModule,
    PromptFileDataset,
)
from lightning_mcore_rl.recipes.response_data import ResponseFileDataModule, ResponseFileDataset
from lightning_mcore_rl.recipes.reward_model import RewardModelModule
from lightning_mcore_rl.recipes.sft import SFTDataModule, SFTModule
from lightning_mcore_rl.recipes.text_task import TextRewardTask
from lightning_mcore_rl.recipes.toy_data import (
    CountingPreferenceDataset,
    CountingSFTDataset,
    collate_pairs,
)

__all__ = [
    "ArithmeticProblem",
    "CountingPreferenceDataset",
    "CountingSFTDataset",
    "DPOModule",
    "DistillationModule",
    "GRPOModule",
    "HFModelSpec",
    "PPOLossFn",
    "PPOModule",
    "PolicyValueChunk",
    "PreferenceDataModule",
    "PromptBatch",
    "PromptDataModule",
    "PromptDataset",
    "PromptFileDataModule",
    "PromptFileDataset",
    "RecipeModel",
    "ResponseFileDataModule",
    "ResponseFileDataset",
    "RewardModelModule",
    "RolloutSpec",
    "SFTDataModule",
    "SFTModule",
    "TeacherSpec",
    "TextRewardTask",
    "TinyGPTSpec",
    "collate_pairs",
    "evaluate_hf",
    "greedy_completions",
    "make_splits",
    "train_tokenizer",
    "write_rl_rows",
    "write_sft_rows",
    "write_tiny_llama",
    "write_tiny_qwen3_moe",
]
