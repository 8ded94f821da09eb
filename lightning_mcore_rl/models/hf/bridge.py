"""`HFBridge`: megatron-core `GPTModel` chunks from a Hugging Face directory, and back (gathered
over TP/PP/VPP, experts over EP and expert TP) to a directory `transformers` loads."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lightning_mcore_rl.models.hf.config import Architecture, parse_architecture
from lightning_mcore_rl.models.hf.moe import check_moe_layout, expert_owners, moe_block_spec
from lightning_mcore_rl.models.hf.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    SafetensorsReader,
    ShardWriter,
    existing_weights,
    is_weight_file,
)
from lightning_mcore_rl.models.hf.weights import (
    ParamMap,
    hf_name_groups,
    hf_shapes,
    merge_shards,
    moe_param_map,
    param_map,
    read_shard,
)
from lightning_mcore_rl.models.layout import (
    check_config_layout,
    layout_groups,
    parallel_config_fields,
)
from lightning_mcore_rl.models.tiny_gpt import is_expert_parameter
from lightning_mcore_rl.parallel import unwrap_model as _unwrap

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer import ModuleSpec, TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from transformers import PreTrainedTokenizerBase

    from lightning_mcore_rl.parallel import ParallelGroups


def _mark_tensor_parallel(model: torch.nn.Module, maps: dict[str, ParamMap]) -> None:
    """Give every TP-split (experts: expert-TP-split) parameter megatron's `tensor_model_parallel`
    attributes, by its layout in `maps` (`dim0`/`qkv`/`fc1`: rows, `dim1`: columns)."""
    # megatron-core 0.16 sets them only inside its random initialisers, which
    # `perform_initialization=False` skips; without them megatron's gradient norm (and so clipping)
    # counts only TP rank 0's shards
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, param in model.named_parameters():
        layout = maps[name].layout
        if layout != "replicated" and not hasattr(param, "tensor_model_parallel"):
            dim = 1 if layout == "dim1" else 0
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=dim, stride=1)


def _global_layer(model: torch.nn.Module, name: str) -> int | None:
    """0-based whole-model index of the decoder layer `name` belongs to (PP/VPP offset included)."""
    parts = name.split(".")
    if parts[:2] != ["decoder", "layers"]:
        return None
    layer: Any = model.get_submodule(f"decoder.layers.{parts[2]}")
    # megatron's layer_number is 1 + get_transformer_layer_offset + the local index
    return int(layer.layer_number) - 1


def default_layer_spec(
    arch: Architecture,
    config: TransformerConfig,
    *,
    pp_rank: int = 0,
    vp_stage: int | None = None,
) -> ModuleSpec | TransformerBlockSubmodules:
    """Transformer Engine's GPT layer spec when TE is importable and CUDA is available, else
    `local_layer_spec`; MoE models get the decoder block spec of stage `pp_rank` (`vp_stage`)."""
    if torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None:
        if arch.moe is not None:
            return moe_block_spec(
                config, pp_rank=pp_rank, vp_stage=vp_stage, transformer_engine=True
            )
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_layernorm)
    return local_layer_spec(arch, config, pp_rank=pp_rank, vp_stage=vp_stage)


def local_layer_spec(
    arch: Architecture,
    config: TransformerConfig,
    *,
    pp_rank: int = 0,
    vp_stage: int | None = None,
) -> ModuleSpec | TransformerBlockSubmodules:
    """megatron's local GPT layer spec with the packed-capable core attention; for a MoE model the
    local decoder block spec of stage `pp_rank` (`vp_stage`), dense and MoE layers per
    `config.moe_layer_freq`."""
    from lightning_mcore_rl.models.layers import get_packed_local_layer_spec

    if arch.moe is not None:
        # a MoE model needs a decoder block spec of this stage's layers, not one layer spec
        return moe_block_spec(config, pp_rank=pp_rank, vp_stage=vp_stage, transformer_engine=False)
    return get_packed_local_layer_spec(qk_layernorm=arch.qk_layernorm, normalization="RMSNorm")


def missing_hf_directory(directory: Path) -> str:
    """Why `directory` (without a `config.json`) is not a Hugging Face model directory."""
    where = directory.resolve()
    expected = (
        "a Hugging Face model directory holds config.json and the *.safetensors weights "
        "(as written by `save_pretrained`, HFExport or `lmrl export`)"
    )
    if not directory.exists():
        return f"The Hugging Face model directory {where} does not exist: {expected}."
    if not directory.is_dir():
        return f"{where} is a file, not a Hugging Face model directory: {expected}."
    return f"No config.json in {where}: {expected}."


class HFBridge:
    """A Hugging Face checkpoint directory seen as megatron-core `GPTModel` chunks (`llama`,
    `qwen2`, `qwen3`, `mistral`, and the routed-expert `qwen3_moe` and `mixtral`); build with
    `from_pretrained`."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        """Same as `from_pretrained`."""
        self.directory = Path(path)
        config_file = self.directory / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(missing_hf_directory(self.directory))
        self.hf_config: dict[str, Any] = json.loads(config_file.read_text())
        self.arch = parse_architecture(self.hf_config)
        self.reader = SafetensorsReader(self.directory)
        self._check_tensors()
        # some tied checkpoints also store the embedding's copy as `lm_head.weight`
        self._head_copy = self.arch.tied_embeddings and "lm_head.weight" in self.reader.names()

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> HFBridge:
        """Open an HF directory (`config.json`, `*.safetensors` sharded or not, any tokenizer
        files), reading only the safetensors headers.

        Raises:
            FileNotFoundError: no `config.json` or no safetensors weights.
            ValueError: unsupported architecture/field, or tensors that do not match the config.
        """
        return cls(path)

    def _check_tensors(self) -> None:
        expected = hf_shapes(self.arch)
        present = set(self.reader.names())
        if self.arch.tied_embeddings:
            present.discard("lm_head.weight")
        missing = sorted(set(expected) - present)
        unexpected = sorted(present - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"The safetensors in {self.directory} do not match config.json "
                f"({self.arch.model_type}): missing {missing[:8]}, unexpected {unexpected[:8]}."
            )
        for name, shape in expected.items():
            if self.reader.shape(name) != shape:
                raise ValueError(
                    f"Tensor {name!r} in {self.directory} has shape {self.reader.shape(name)}; "
                    f"config.json implies {shape}."
                )

    @property
    def vocab_size(self) -> int:
        """`V` (`config.json`'s `vocab_size`; never padded)."""
        return self.arch.vocab_size

    def config_fields(self) -> dict[str, Any]:
        """The architecture's `TransformerConfig` kwargs, without parallel sizes or dtypes."""
        # no parallel sizes or dtypes: a LightningModule's `transformer_config(**fields)` adds the
        # strategy's
        return self.arch.config_fields()

    def transformer_config(
        self, groups: ParallelGroups | None = None, **overrides: Any
    ) -> TransformerConfig:
        """`TransformerConfig` of the architecture with the parallel sizes of `groups` (`None`: one
        rank) and `pipeline_dtype = params_dtype` (fp32 by default); `overrides` win over both."""
        from megatron.core.transformer import TransformerConfig

        fields = {
            **self.config_fields(),
            **parallel_config_fields(layout_groups(groups)),
            "pipeline_dtype": overrides.get("params_dtype", torch.float32),
            **overrides,
        }
        return TransformerConfig(**fields)

    def build_chunk(
        self,
        config: TransformerConfig,
        vp_stage: int | None = None,
        *,
        groups: ParallelGroups | None = None,
        transformer_layer_spec: ModuleSpec | TransformerBlockSubmodules | None = None,
    ) -> GPTModel:
        """This rank's `GPTModel` chunk for virtual stage `vp_stage`, its shards of the HF weights
        loaded (`config` e.g. `transformer_config`, sized for `groups`; `None`: one rank).

        Raises:
            ValueError: a layout `check_parallel_layout` refuses, sizes other than `groups`', or a
                shard of the wrong shape.
        """
        from megatron.core.models.gpt import GPTModel

        # megatron's layers read its parallel state: it must be initialised for the same layout as
        # `groups`
        check_parallel_layout(self.arch, config)
        groups = layout_groups(groups)
        check_config_layout(config, groups)
        spec = transformer_layer_spec or default_layer_spec(
            self.arch, config, pp_rank=groups.pp_rank, vp_stage=vp_stage
        )
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            pre_process=groups.is_first_stage(vp_stage),
            post_process=groups.is_last_stage(vp_stage),
            vp_stage=vp_stage,
            **self.arch.gpt_model_kwargs(),
        )
        _mark_tensor_parallel(model, self._param_maps(model, groups))
        self._load(model, groups)
        return model

    def load_weights(self, chunk: torch.nn.Module, groups: ParallelGroups | None = None) -> None:
        """Overwrite a built chunk (possibly wrapped) of `groups`' layout with this directory's
        weights again, e.g. for a reference policy; `ValueError` if its config has other sizes."""
        groups = layout_groups(groups)
        model = _unwrap(chunk)
        check_config_layout(model.config, groups)
        self._load(model, groups)

    def _param_maps(self, model: torch.nn.Module, groups: ParallelGroups) -> dict[str, ParamMap]:
        """`megatron parameter name -> ParamMap` of a chunk of `groups`' layout (local experts named
        by their global index)."""
        moe = self.arch.moe
        first_expert = 0 if moe is None else groups.ep_rank * moe.num_experts // groups.ep_size
        maps = {}
        for name, _ in model.named_parameters():
            layer = _global_layer(model, name)
            pm = None if moe is None else moe_param_map(name, layer, moe, first_expert)
            maps[name] = pm or param_map(name, layer, self.arch.tied_embeddings)
        return maps

    @torch.no_grad()
    def _load(self, model: torch.nn.Module, groups: ParallelGroups) -> None:
        maps = self._param_maps(model, groups)
        for name, param in model.named_parameters():
            pm = maps[name]
            expert = is_expert_parameter(name)
            rank, world = (
                (groups.etp_rank, groups.etp_size) if expert else (groups.tp_rank, groups.tp_size)
            )
            # each rank reads only its slices: under EP only its experts, each expert's expert-TP
            # shard
            shard = read_shard(self.reader, pm, self.arch, rank, world)
            if shard.shape != param.shape:
                raise ValueError(
                    f"megatron parameter {name!r} has shape {tuple(param.shape)} on "
                    f"{'expert ' if expert else ''}TP rank {rank}/{world}, but {pm.hf_names} "
                    f"give {tuple(shard.shape)}."
                )
            param.copy_(shard)

    def export_hf_weights(
        self,
        chunks: Sequence[torch.nn.Module],
        groups: ParallelGroups | None = None,
        dtype: torch.dtype | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective over `groups`' TP, PP (MoE: EP and expert-TP) groups: yield
        `(hf_name, full CPU tensor)` one at a time, on every rank, in HF module order; `ValueError`
        (before any collective) if a chunk's config has other sizes than `groups`."""
        groups = layout_groups(groups)
        models = [_unwrap(chunk) for chunk in chunks]
        for model in models:
            check_config_layout(model.config, groups)
        # the layout checks read only sizes: they run before the first collective
        shapes = hf_shapes(self.arch)
        local: dict[str, tuple[ParamMap, str, torch.Tensor]] = {}
        moe_layers: set[int] = set()
        for model in models:
            for name, pm in self._param_maps(model, groups).items():
                if name == "output_layer.weight" and self.arch.tied_embeddings:
                    continue  # the last stage's copy of the embedding
                local[pm.hf_names[0]] = (pm, name, model.get_parameter(name))
                layer = _global_layer(model, name)
                if name.endswith(".mlp.router.weight") and layer is not None:
                    moe_layers.add(layer)
        # every expert of this stage's MoE layers reaches all its ranks (EP broadcast)
        stage_experts = (
            {}
            if self.arch.moe is None
            else expert_owners(self.arch.moe, moe_layers, groups.ep_size)
        )
        # every rank yields every tensor: gathered over TP (experts over expert TP, then broadcast
        # over EP from the rank holding them) and broadcast over PP from the stage holding it
        owner = _owners(sorted(set(local) | set(stage_experts)), groups)
        device = next(iter(local.values()))[2].device
        for key, names in hf_name_groups(self.arch).items():
            if key in local:
                pm, name, mine = local[key]
                expert = is_expert_parameter(name)
                group, size = (
                    (groups.etp_group, groups.etp_size)
                    if expert
                    else (groups.tp_group, groups.tp_size)
                )
                shards = [mine.detach().clone()]  # never yield a view of a live parameter
                if size > 1:
                    shards = [torch.empty_like(mine) for _ in range(size)]
                    dist.all_gather(shards, mine.detach().contiguous(), group=group)
                tensors = merge_shards(pm, shards, self.arch)
            else:
                # another stage holds it: an empty buffer the PP broadcast below fills
                tensors = [torch.empty(shapes[n], device=device) for n in names]
            for name, tensor in zip(names, tensors, strict=True):
                # by default each tensor keeps the source checkpoint's dtype
                out = tensor.to(dtype or self.reader.dtype(name)).contiguous()
                if key in stage_experts and groups.ep_size > 1:
                    ep_ranks = dist.get_process_group_ranks(groups.ep_group)
                    dist.broadcast(out, src=ep_ranks[stage_experts[key][1]], group=groups.ep_group)
                if groups.pp_size > 1:
                    dist.broadcast(out, src=owner[key], group=groups.pp_group)
                yield name, out.cpu()
                if name == "model.embed_tokens.weight" and self._head_copy:
                    yield "lm_head.weight", out.cpu()

    def save_pretrained(
        self,
        chunks: Sequence[torch.nn.Module],
        out_dir: str | os.PathLike[str],
        *,
        groups: ParallelGroups | None = None,
        dtype: torch.dtype | None = None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ) -> None:
        """Collective over the world: global rank 0 writes an HF directory: the source `config.json`
        (its `dtype` set when given), the other non-weight files, and the weights as safetensors
        shards of at most `max_shard_bytes` (with an index when several).

        Raises:
            FileExistsError: `out_dir` already holds weights.
        """
        out = Path(out_dir)
        writer = ShardWriter(out, max_shard_bytes) if dist.get_rank() == 0 else None
        # rank 0's answer goes to every rank, so that all raise together instead of hanging in the
        # export's collectives
        error = [existing_weights(out) if writer is not None else None]
        dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            raise FileExistsError(error[0])
        if writer is not None:
            out.mkdir(parents=True, exist_ok=True)
            for item in sorted(self.directory.iterdir()):
                if item.is_file() and not is_weight_file(item.name):
                    shutil.copy2(item, out / item.name)
            if dtype is not None:
                config = {**self.hf_config, "dtype": str(dtype).removeprefix("torch.")}
                (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for name, tensor in self.export_hf_weights(chunks, groups, dtype):
            if writer is not None:
                writer.add(name, tensor)
        if writer is not None:
            writer.close()
        # no rank returns before rank 0 has written the whole directory
        dist.barrier()

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """`transformers.AutoTokenizer` of the same directory (chat template included)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.directory))


_TP_REMEDY = {
    "vocab_size": "the vocabulary is not padded (see docs/models.md)",
    "num_key_value_heads": "the bridge gives each TP rank whole key/value heads (no replication)",
    "intermediate_size": "each TP rank holds an equal slice of the MLP",
}


def check_parallel_layout(arch: Architecture, config: TransformerConfig) -> None:
    """Refuse (`ValueError` naming the HF field, the sizes and the remedy) layers not split evenly
    over PP (x VPP) unless `config` asks for an uneven split, TP not dividing the vocab, key/value
    heads or dense MLP width, or an expert layout `check_moe_layout` refuses."""
    # megatron would stop with a bare `AssertionError`, or the checkpoint would need padding; only
    # sizes are read, so this runs before any collective
    uneven = (
        config.num_layers_in_first_pipeline_stage is not None
        or config.num_layers_in_last_pipeline_stage is not None
        or config.account_for_embedding_in_pipeline_split
        or config.account_for_loss_in_pipeline_split
    )
    layers, pp = config.num_layers, config.pipeline_model_parallel_size
    vpp = config.virtual_pipeline_model_parallel_size
    if not uneven and layers % pp != 0:
        raise ValueError(
            f"`num_hidden_layers` ({layers}) must be divisible by the pipeline-parallel size "
            f"({pp}): every stage builds the same number of layers. Use a PP size that divides "
            f"{layers}."
        )
    if not uneven and vpp is not None and pp > 1 and (layers // pp) % vpp != 0:
        raise ValueError(
            f"`num_hidden_layers` ({layers}) over the pipeline-parallel size ({pp}) gives "
            f"{layers // pp} layers per stage, which the virtual pipeline size ({vpp}) does not "
            f"divide. Use sizes with num_hidden_layers divisible by PP x VPP ({pp * vpp}), "
            "or no virtual pipeline."
        )
    tp = config.tensor_model_parallel_size
    sizes = [("vocab_size", arch.vocab_size), ("num_key_value_heads", arch.num_query_groups)]
    if any(arch.dense_layers):  # Mixtral's `intermediate_size` is its experts' width
        sizes.append(("intermediate_size", arch.ffn_hidden_size))
    for field, size in sizes:
        if size % tp != 0:
            raise ValueError(
                f"`{field}` ({size}) must be divisible by the tensor-parallel size ({tp}): "
                f"{_TP_REMEDY[field]}. Use a TP size that divides {size}."
            )
    check_moe_layout(arch, config)


def _owners(keys: list[str], groups: ParallelGroups) -> dict[str, int]:
    """`HF name -> global rank of the pipeline stage holding it` for every name of the pipeline."""
    # one `all_gather_object` over PP; PP = 1: this rank's keys, owned by this rank
    if groups.pp_size == 1:
        return dict.fromkeys(keys, dist.get_rank() if dist.is_initialized() else 0)
    pp_ranks = dist.get_process_group_ranks(groups.pp_group)
    owned: list[list[str]] = [[] for _ in pp_ranks]
    dist.all_gather_object(owned, keys, group=groups.pp_group)
    return {key: pp_ranks[stage] for stage, names in enumerate(owned) for key in names}
