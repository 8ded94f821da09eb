"""The CPU backend: megatron-core's real schedules, DDP, optimizers and checkpointing on CPU with
gloo, through a scoped CUDA-to-CPU emulation (`cpu_emulation`)."""

# `MCoreRLStrategy` enters it in `setup_environment` when the Trainer runs on CPU and leaves it in
# `teardown`
from lightning_mcore_rl.cpu.emulation import cpu_emulation, emulation_active, patched_attributes

__all__ = ["cpu_emulation", "emulation_active", "patched_attributes"]
