"""The EAGLE-3 export against vLLM's loader (no vLLM needed): the ``config.json`` fields vLLM reads
for the draft's aux layers (top-level ids for both model runners, ``num_aux_hidden_states`` for
``llama_eagle3.py``'s ``fc``), and the refusal of a draft a vLLM release cannot serve as trained
(``fc`` hard-coded ``[H, 3H]`` before 0.22; the target's default layers captured before 0.12),
raised before the export's TP gather and before anything is written."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from lightning_mcore_rl.models.eagle3 import (
    VLLM_FC_FROM_CONFIG,
    VLLM_IDS_FROM_CONFIG,
    check_vllm_loads_eagle3,
)
from lightning_mcore_rl.testing import run_on_ranks

FC = ".".join(map(str, VLLM_FC_FROM_CONFIG))
IDS = ".".join(map(str, VLLM_IDS_FROM_CONFIG))


def test_release_constants_are_the_first_that_read_the_config() -> None:
    # llama_eagle3.py sizes fc [H, 3H] in 0.21.0 and from the config in 0.22.0; the runner reads
    # the config's ids in 0.12.0, not in 0.11.0 (docs/speculative-decoding.md, "vLLM releases")
    assert (0, 21, 0) < VLLM_FC_FROM_CONFIG <= (0, 22, 0)
    assert (0, 11, 0) < VLLM_IDS_FROM_CONFIG <= (0, 12, 0)


@pytest.mark.parametrize("version", ["0.21.0", "0.11.0", "0.9.0", "0.8.5.post1"])
def test_a_two_aux_draft_is_refused_where_vllm_builds_fc_for_three(version: str) -> None:
    message = (
        f"vLLM {version} cannot load this EAGLE-3 draft: it reads 2 aux layers (1, 3) "
        f"(fc.weight [H, 2H]), but vLLM < {FC} builds llama_eagle3's fc for exactly 3 aux hidden "
        "states (fc.weight [H, 3H]). Build the draft with 3 aux layers "
        f"(eagle3_draft(..., aux_layers=(i, j, l))), or serve it with vLLM >= {FC}."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_vllm_loads_eagle3((1, 3), version, target_num_layers=4)


@pytest.mark.parametrize("version", [FC, "0.32.0", "0.32.0+cpu", "0.34.0", "1.0"])
@pytest.mark.parametrize("aux", [(1,), (1, 3), (0, 1, 2, 3)])
def test_any_aux_count_is_accepted_where_vllm_sizes_fc_from_the_config(
    version: str, aux: tuple[int, ...]
) -> None:
    check_vllm_loads_eagle3(aux, version, target_num_layers=4)


def test_layers_other_than_the_targets_defaults_are_refused_where_vllm_ignores_the_ids() -> None:
    # an 8-layer Llama's default ids (2, 4, 5) are the outputs of 0-based layers (1, 3, 4)
    message = (
        f"vLLM 0.11.0 would feed this EAGLE-3 draft other target layers than it was trained on: "
        f"vLLM < {IDS} ignores the config's aux layer ids and captures the outputs of 0-based "
        "layers (1, 3, 4) of the 8-layer target, but the draft reads layers (0, 3, 7). Build the "
        f"draft with aux_layers=(1, 3, 4), or serve it with vLLM >= {IDS}."
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_vllm_loads_eagle3((0, 3, 7), "0.11.0", target_num_layers=8)
    check_vllm_loads_eagle3((1, 3, 4), "0.11.0", target_num_layers=8)
    check_vllm_loads_eagle3((0, 3, 7), IDS, target_num_layers=8)
    check_vllm_loads_eagle3((0, 3, 7), "0.11.0")  # the target's depth unknown: not checked


def test_a_version_that_is_not_one_is_named() -> None:
    with pytest.raises(ValueError, match=r"must be a vLLM release like '0.32.0', got 'latest'"):
        check_vllm_loads_eagle3((0, 1, 2), "latest")


def _export(rank: int, root: str, aux: tuple[int, ...], version: str | None) -> dict[str, Any]:
    """A 4-layer policy's EAGLE-3 draft reading ``aux``, exported for vLLM ``version``."""
    from lightning_mcore_rl.models.eagle3 import eagle3_draft, save_eagle3
    from lightning_mcore_rl.models.tiny_gpt import tiny_gpt_config
    from lightning_mcore_rl.testing import init_megatron_state

    init_megatron_state()
    draft = eagle3_draft(tiny_gpt_config(num_layers=4), vocab_size=16, aux_layers=aux)
    try:
        save_eagle3(draft, root, max_position_embeddings=64, vllm_version=version)
    except ValueError as error:
        return {"error": str(error)}
    return {"config": json.loads((Path(root) / "config.json").read_text())}


def test_the_config_names_the_aux_layers_where_both_vllm_runners_read_them(tmp_path: Path) -> None:
    out = run_on_ranks(_export, 1, str(tmp_path), (1, 3), "0.32.0", timeout=120)[0]
    config = out["config"]
    # the V2 runner (vLLM's only one from 0.34 on) reads the top-level ids alone
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4]
    assert config["eagle_config"] == {"use_aux_hidden_state": True,
                                      "eagle_aux_hidden_state_layer_ids": [2, 4]}  # fmt: skip
    assert config["num_aux_hidden_states"] == 2  # llama_eagle3.py: fc [H, 2H]


def test_a_draft_the_release_cannot_load_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    out = run_on_ranks(_export, 1, str(tmp_path / "draft"), (1, 3), "0.21.0", timeout=120)[0]
    assert out["error"].startswith("vLLM 0.21.0 cannot load this EAGLE-3 draft: it reads 2 aux")
    assert not (tmp_path / "draft").exists()
