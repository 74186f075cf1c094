"""vLLM inference engine (GPU): step-driven continuous batching, interrupt + resume, weight reload.

UNTESTED ON THIS MACHINE: written against the vLLM (>= 0.10, V1 engine) API without a GPU or
vllm installed here; the torch engine is the reference implementation and its tests define the
expected behaviour. Run a GPU smoke test before relying on it.

Invariants (same as ``TorchInferenceEngine``):
- behaviour log-prob = ``log_softmax(logits / T)`` at the sampled token: requests ask for
  ``logprobs=0`` (the sampled token only) and the engine is built with
  ``logprobs_mode="processed_logprobs"`` so vLLM reports them after temperature scaling.
  NOTE: vLLM's "processed" log-probs may also include top-p/top-k masking, unlike the torch
  engine; keep top_p = 1 for RL or check this on the installed version.
- Interruption: at every engine step ``poll_weights`` is asked; on an update every unfinished
  request is aborted, the weights are loaded into the worker(s), the prefix cache is reset and
  every request is re-submitted as prompt + tokens so far, with the remaining token budget.
"""

from __future__ import annotations

from typing import Any

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
from areal.engines.torch_infer import resolve_dtype
from areal.engines.weights_check import TensorSpec, check_state_dict, spec_of_hf_dir

__all__ = ["VLLMInferenceEngine"]


def _load_weights_on_worker(self, items):  # runs inside each vLLM worker via collective_rpc
    self.model_runner.model.load_weights(weights=items)


class VLLMInferenceEngine:
    """Built from an ``InferenceEngineConfig`` of kind "vllm" (``device`` is ignored: vLLM
    places itself); ``version`` starts at 0."""

    def __init__(self, cfg: InferenceEngineConfig) -> None:
        from vllm import LLM

        if cfg.kind != "vllm":
            raise ValueError(f"VLLMInferenceEngine needs a config of kind 'vllm', got {cfg.kind!r}")
        self.cfg = cfg
        self.llm = LLM(
            model=cfg.model_path,
            dtype=str(resolve_dtype(cfg.dtype)).removeprefix("torch."),  # "bf16" -> "bfloat16"
            seed=cfg.seed,
            max_num_seqs=cfg.max_batch_size,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            tensor_parallel_size=cfg.tensor_parallel_size,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",
            skip_tokenizer_init=True,
        )
        self.engine = self.llm.llm_engine
        self._spec = self._weights_spec()
        self.version = 0
        self._n_submits = 0
        self.max_batch_size = cfg.max_batch_size

    def _weights_spec(self) -> tuple[dict[str, TensorSpec], frozenset[str]]:
        """What a weights blob must match: the HF names and shapes of the model dir (vLLM's own
        parameters are fused); a tied `lm_head.weight` may come along or not."""
        spec = spec_of_hf_dir(self.cfg.model_path)
        embed = spec.get("model.embed_tokens.weight")
        if self._tied() and "lm_head.weight" not in spec and embed is not None:
            spec["lm_head.weight"] = embed
            return spec, frozenset({"lm_head.weight"})
        return spec, frozenset()

    def check_weights(self, state_dict: dict[str, Any], version: int) -> None:
        """Raise `WeightsMismatch` unless `state_dict` fits the model whole (names, shapes,
        dtypes, finite values: `areal.engines.weights_check`); touches no parameter."""
        spec, optional = self._spec
        check_state_dict(spec, state_dict, optional=optional, what=f"weights v{version}")

    def load_weights(self, update: WeightUpdate) -> None:
        """Check the whole state dict, then copy it: a refused one changes no parameter."""
        self.check_weights(update.state_dict, update.version)
        items = [
            (k, v)
            for k, v in update.state_dict.items()
            if k != "lm_head.weight" or not self._tied()
        ]
        self.llm.collective_rpc(_load_weights_on_worker, args=(items,))
        self.llm.reset_prefix_cache()  # cached KV blocks belong to the old weights
        self.version = update.version

    def _tied(self) -> bool:
        return bool(getattr(self.engine.model_config.hf_config, "tie_word_embeddings", False))

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
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        stop_ids = set(params.stop_token_ids)
        state: dict[str, dict[str, Any]] = {}  # vllm request id -> row state
        results: list[GenOutput | None] = [None] * len(requests)

        def finish(st: dict[str, Any], reason: str) -> None:
            out = GenOutput(
                key=st["req"].key,
                output_ids=st["ids"],
                behav_logp=st["logp"],
                versions=st["versions"],
                finish_reason=reason,
                n_interrupts=st["n_interrupts"],
                n_reprefill_tokens=st["n_reprefill"],
            )
            results[st["idx"]] = out
            if on_finished is not None:
                on_finished(out)

        def submit(st: dict[str, Any]) -> str:
            self._n_submits += 1
            rid = f"{st['req'].key}#{self._n_submits}"
            sp = VSamplingParams(
                n=1,
                temperature=params.temperature,
                top_p=params.top_p,
                max_tokens=(st["req"].max_new_tokens or params.max_new_tokens) - len(st["ids"]),
                stop_token_ids=list(params.stop_token_ids),
                ignore_eos=True,  # only our stop ids end a sample
                logprobs=0,
                detokenize=False,
            )
            prompt = TokensPrompt(prompt_token_ids=list(st["req"].prompt_ids) + st["ids"])
            self.engine.add_request(rid, prompt, sp)
            st["seen"] = 0  # tokens of this submission already recorded
            state[rid] = st
            return rid

        def admit(i: int, req: GenRequest) -> None:
            if not req.prompt_ids:
                raise ValueError(f"request {req.key!r} has an empty prompt")
            st: dict[str, Any] = {
                "idx": i,
                "req": req,
                "ids": [],
                "logp": [],
                "versions": [],
                "n_interrupts": 0,
                "n_reprefill": 0,
            }
            if (req.max_new_tokens or params.max_new_tokens) < 1:  # vLLM needs max_tokens >= 1
                finish(st, "length")
            else:
                submit(st)

        for i, req in enumerate(requests):
            admit(i, req)

        while True:
            if poll_requests is not None and len(state) < self.max_batch_size:
                for req in poll_requests():  # continuous batching across calls
                    results.append(None)
                    admit(len(results) - 1, req)
            if not state:
                break
            update = poll_weights() if poll_weights is not None else None
            if update is not None:
                rows = list(state.items())
                self.engine.abort_request([rid for rid, _ in rows])
                state.clear()
                self.load_weights(update)
                for _, st in rows:
                    st["n_interrupts"] += 1
                    st["n_reprefill"] += len(st["req"].prompt_ids) + len(st["ids"])
                    submit(st)
            for ro in self.engine.step():
                st = state.get(ro.request_id)
                if st is None:
                    continue
                comp = ro.outputs[0]
                new_ids = list(comp.token_ids)[st["seen"] :]
                new_lps = comp.logprobs[st["seen"] :]
                for tok, lp in zip(new_ids, new_lps, strict=True):
                    st["ids"].append(int(tok))
                    st["logp"].append(float(lp[tok].logprob))
                    st["versions"].append(self.version)
                st["seen"] += len(new_ids)
                if ro.finished:
                    last = st["ids"][-1] if st["ids"] else None
                    finish(state.pop(ro.request_id), "stop" if last in stop_ids else "length")
        return results  # type: ignore[return-value]
