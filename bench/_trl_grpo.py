"""One TRL `GRPOTrainer` run with the settings of an areal run config (bench/vs_trl.py).

Run as its own process, so its start-up (imports, model load, trainer build) is timed like a
whole `areal run`:

    python bench/_trl_grpo.py CONFIG --model DIR --out DIR [--set k=v ...] [--t0 EPOCH_S]
        [--threads 1]

Everything is derived from the same `RunSettings` that `areal run CONFIG --set ...` resolves
(`grpo_kwargs`; the mapping is in bench/vs_trl.py's docstring): the task source and prompt
rendering of areal's controller (`make_sources`, `PromptBuilder`), the reward function of its
reward worker (`get_reward_fn(settings.reward_fn_name())`), the stop ids of its rollout worker.

Writes into --out, in areal's formats where they overlap:
- `metrics.jsonl`: one record per areal-sized step (B prompts x G completions, i.e. one TRL
  generation batch = `n_minibatches` optimizer steps): `step`, `wall_s` (since the trainer's
  `on_train_begin`, like areal's trainer wall time), `proc_s` (since --t0, the parent's clock
  when it spawned this process), `reward_mean`, `samples`, `tokens`, `gen_len_mean`;
- `summary.json`: `startup_s` (--t0 -> `on_train_begin`), `first_step_s`, versions, threads and
  the `GRPOConfig` fields that were set;
- `final/`: the trained model and tokenizer (saved after the last record, so untimed).
Invariant: a record's reward is the mean of exactly the rewards TRL trained that step on (the
reward function is wrapped, not re-evaluated).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent)]  # the repo: areal.*


def grpo_kwargs(s: Any, out_dir: Path) -> dict[str, Any]:
    """`GRPOConfig` keyword arguments for areal settings `s` (see bench/vs_trl.py)."""
    a, r, t = s.algo, s.rollout, s.train
    n_seqs = a.batch_size * a.group_size
    if n_seqs % t.n_minibatches:
        raise ValueError(
            f"B*G = {n_seqs} is not divisible by train.n_minibatches={t.n_minibatches}: TRL "
            "splits a generation batch into equal optimizer-step slices"
        )
    return dict(
        output_dir=str(out_dir / "trl"),
        seed=s.seed,
        data_seed=s.seed,
        use_cpu=s.model.device == "cpu",
        bf16=False,
        fp16=False,  # areal trains in model.dtype (float32 here)
        gradient_checkpointing=t.gradient_checkpointing,  # GRPOConfig's default is True
        # B x G completions per generation, n_minibatches optimizer steps over it
        num_generations=a.group_size,
        per_device_train_batch_size=n_seqs // t.n_minibatches,
        steps_per_generation=t.n_minibatches,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_steps=t.total_steps * t.n_minibatches,
        shuffle_dataset=False,  # task k of the run is item k of the source, as areal's controller
        # sampling
        max_completion_length=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=0,
        # objective: GRPO advantages, PPO clip, token-mean loss, no KL term
        beta=0.0,
        epsilon=a.eps_clip_low,
        epsilon_high=a.eps_clip_high,
        scale_rewards="group" if a.advantage == "grpo" else "none",
        loss_type="dapo",
        mask_truncated_completions=s.rollout.overlong == "mask",
        # optimizer: AdamW (0.9, 0.999, 1e-8), constant lr, areal's clip and weight decay
        optim="adamw_torch",
        learning_rate=t.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=t.weight_decay,
        max_grad_norm=t.grad_clip,
        # bookkeeping
        logging_steps=10 * t.n_minibatches,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


class _Recorder:
    """The reward function TRL calls (areal's scorer, wrapped) and the step callback."""

    def __init__(self, reward_fn: Any, metrics: Path, t0: float, n_minibatches: int) -> None:
        self.reward_fn, self.metrics, self.t0, self.n_mb = reward_fn, metrics, t0, n_minibatches
        self.t_train0: float | None = None
        self.first_step_s: float | None = None
        self.pending: dict[str, Any] | None = None  # the last generation batch's stats
        self.__name__ = getattr(reward_fn, "__name__", "reward")  # TRL names metrics by it

    def __call__(self, completions: list[str], answer: list[str], completion_ids: list, **_):
        rewards = [float(self.reward_fn(c, a)) for c, a in zip(completions, answer, strict=True)]
        lens = [len(ids) for ids in completion_ids]
        self.pending = {
            "reward_mean": sum(rewards) / len(rewards),
            "samples": len(rewards),
            "tokens": sum(lens),
            "gen_len_mean": sum(lens) / len(lens),
        }
        return rewards

    def callback(self) -> Any:
        from transformers import TrainerCallback

        rec = self

        class StepRecords(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                rec.t_train0 = time.time()

            def on_step_end(self, args, state, control, **kw):
                if state.global_step % rec.n_mb or rec.pending is None:
                    return
                now = time.time()
                row = {
                    "step": state.global_step // rec.n_mb,
                    "wall_s": round(now - rec.t_train0, 3),
                    "proc_s": round(now - rec.t0, 3),
                    **rec.pending,
                }
                if rec.first_step_s is None:
                    rec.first_step_s = now - rec.t0
                with open(rec.metrics, "a") as f:
                    f.write(json.dumps(row) + "\n")

        return StepRecords()


def main() -> int:
    ap = argparse.ArgumentParser(description="one TRL GRPO run with an areal config's settings")
    ap.add_argument("config", type=Path)
    ap.add_argument("--model", required=True, help="HF model dir (bench/_rl.py prewarm)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--t0", type=float, help="epoch seconds the parent spawned this process")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    t0 = args.t0 or time.time()

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from areal.config import load_settings
    from areal.data.prompts import PromptBuilder, stop_token_ids
    from areal.data.sources import make_sources
    from areal.data.tokenizer import load_tokenizer
    from areal.rewards.registry import get_reward_fn

    hf_logging.set_verbosity_error()
    s = load_settings(args.config, args.overrides)
    args.out.mkdir(parents=True, exist_ok=True)
    metrics = args.out / "metrics.jsonl"
    metrics.unlink(missing_ok=True)

    tok = load_tokenizer(args.model)
    source, _ = make_sources(s.data, s.seed)  # the controller's training side
    prompts = PromptBuilder(s.prompt, tok)
    n_tasks = s.algo.batch_size * s.train.total_steps
    items = [source.get(i) for i in range(n_tasks)]
    texts = [prompts.text(it) for it in items]
    for it, text in zip(items[:64], texts[:64], strict=True):  # TRL encodes the text itself
        if tok(text=text)["input_ids"] != prompts.ids(it):
            raise SystemExit(f"TRL would encode prompt {text!r} differently from areal")
    dataset = Dataset.from_dict({"prompt": texts, "answer": [it.answer for it in items]})

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, s.model.dtype))
    model.generation_config.eos_token_id = list(stop_token_ids(tok, args.model, s.prompt.stop))
    rec = _Recorder(get_reward_fn(s.reward_fn_name()), metrics, t0, s.train.n_minibatches)
    kwargs = grpo_kwargs(s, args.out)
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=rec,
        args=GRPOConfig(**kwargs),
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[rec.callback()],
    )
    trainer.train()
    t_end = time.time()
    trainer.save_model(str(args.out / "final"))
    import trl

    summary = {
        "startup_s": (rec.t_train0 or t_end) - t0,
        "first_step_s": rec.first_step_s,
        "train_s": t_end - (rec.t_train0 or t_end),
        "trl": trl.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "pid": os.getpid(),
        "grpo_config": {k: v for k, v in kwargs.items() if k != "output_dir"},
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
