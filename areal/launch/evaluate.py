"""`areal eval MODEL_DIR`: greedy accuracy and sampled pass@k of a model directory on a held-out
set, with the prompts, chat template and reward of a run.

It is the in-run evaluation's code, run once on a model dir: the rollout worker's preparation
(`workers.rollout.prepare`: tokenizer, stop ids, engine, sampling parameters, decoding) and eval
plan (`workers.rollout.eval_plan`: the held-out set of `areal.data.sources.held_out_source`
rendered by the controller's `PromptBuilder`), generation by `Evaluator.generate`, scoring by
`Evaluator.score` (the run's reward function in a scoring process, with its per-sample
timeout) and the round's numbers by `Evaluator.summary`.

Invariants:
- With a run's config, greedy decoding of its final model answers the run's held-out set the
  way an in-run round at the final version does: same items in the same order, same prompts,
  engine settings and reward, so `greedy.mean_reward` is that round's `eval_reward`.
- `--data SPEC` replaces the held-out set with SPEC (as `data.eval_source`: all of a finite
  source, or its first `--limit` items; a procedural one needs `--limit`); without it the
  config's held-out set (`data.eval_size` / `data.eval_source`) is used, cut to `--limit`.
- A sample is correct when its reward reaches `correct_at` (default: the top of the scorer's
  range, 1 for the built-ins). pass@k is the unbiased estimator over `n` samples of each item
  (`areal.algo.pass_at_k`), drawn at `temperature` (default: the run's `rollout.temperature`).
- Nothing is written but `--out` (the JSON report); the table goes to stdout.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal.config import RunSettings

__all__ = ["EvalError", "EvalRequest", "eval_settings", "evaluate_model", "format_report"]


class EvalError(Exception):
    """Bad input to `areal eval` (a one-line message that names the fix)."""


@dataclass(frozen=True)
class EvalRequest:
    model_dir: str
    config: str | None = None  # a run config (YAML) or a run dir's config.json
    data: str | None = None  # a held-out source spec replacing the config's held-out set
    split: str | None = None  # the split of an hf: --data (data.eval_split)
    reward: str | None = None  # reward.fn
    engine: str | None = None  # rollout.engine
    n: int = 0  # samples per item for pass@k; 0 = greedy only
    ks: tuple[int, ...] = ()  # pass@k for these k; () = 1 and n
    temperature: float | None = None  # sampling temperature; None = rollout.temperature
    max_new_tokens: int | None = None  # eval.max_new_tokens
    limit: int | None = None  # items at most
    correct_at: float | None = None  # a sample is correct when its reward >= this
    overrides: tuple[str, ...] = ()  # --set KEY=VALUE of the run config


def _q(value: str) -> str:
    """A `--set` value that YAML reads back as this very string."""
    return json.dumps(value)


def eval_settings(req: EvalRequest) -> RunSettings:
    """The run settings `req` evaluates with: the config and its `--set`s, then the model dir,
    the data, reward, engine and eval caps of the command line."""
    from areal.config import ConfigError, load_settings

    if not (Path(req.model_dir) / "config.json").is_file():
        raise EvalError(
            f"{req.model_dir} is not a model directory (no config.json): give a Hugging Face "
            "model dir, e.g. a run's <out>/final"
        )
    sets = [*req.overrides, f"model.path={_q(str(req.model_dir))}"]
    if req.data is not None:
        from areal.data.sources import is_finite

        if not is_finite(req.data) and not req.limit:
            raise EvalError(f"--data {req.data} is procedural: give --limit N, the items to draw")
        sets += [f"data.eval_source={_q(req.data)}", f"data.eval_size={req.limit or 0}"]
        if req.split is not None:
            sets.append(f"data.eval_split={_q(req.split)}")
    elif req.split is not None:
        raise EvalError("--split names the split of an hf: --data; give --data too")
    if req.reward is not None:
        sets.append(f"reward.fn={_q(req.reward)}")
    if req.engine is not None:
        sets.append(f"rollout.engine={req.engine}")
    if req.max_new_tokens is not None:
        sets.append(f"eval.max_new_tokens={req.max_new_tokens}")
    try:
        s = load_settings(req.config, sets)
    except ConfigError as e:
        raise EvalError(str(e)) from None
    if not (s.data.eval_size or s.data.eval_source):
        raise EvalError(
            "the config holds out no items (data.eval_size 0, no data.eval_source): give "
            "--data SPEC (e.g. a test file or hf:DIR), or --set data.eval_size=N"
        )
    if not s.eval.every_versions:  # the eval plan exists for evaluating runs; nothing else reads it
        s = s.model_copy(update={"eval": s.eval.model_copy(update={"every_versions": 1})})
    return s


def _sample_ks(req: EvalRequest) -> tuple[int, ...]:
    ks = req.ks or tuple(sorted({1, req.n}))
    bad = [k for k in ks if not 1 <= k <= req.n]
    if bad:
        raise EvalError(f"--k {','.join(map(str, bad))}: each k must be in [1, --n {req.n}]")
    return ks


def _round(evaluator: Any, parts: Any) -> tuple[dict[str, Any], list[str], list[float]]:
    """One round as the rollout service runs it: generate, decode, score, summarise."""
    t0 = time.perf_counter()
    try:
        version, outs = evaluator.generate(parts.engine)
        texts = [parts.decode_text(o.output_ids) for o in outs]
        scores = asyncio.run(evaluator.score(texts))
    finally:
        evaluator.close()
    summary = evaluator.summary(0, version, outs, scores, time.perf_counter() - t0)
    return summary, texts, [reward for reward, _ in scores]


def _correct_at(s: RunSettings, req: EvalRequest) -> float:
    if req.correct_at is not None:
        return req.correct_at
    hi = s.score_range()[1]
    return hi if math.isfinite(hi) else 1.0


def evaluate_model(req: EvalRequest) -> dict[str, Any]:
    """The report of `areal eval` (module invariants)."""
    from areal.algo.pass_at_k import mean_pass_at_k
    from areal.config import ConfigError
    from areal.launch.preflight import check_extras

    if req.n < 0 or (req.limit is not None and req.limit < 1):
        raise EvalError("--n must be >= 0 and --limit >= 1")
    ks = _sample_ks(req) if req.n else ()
    s = eval_settings(req)
    try:
        check_extras(s, ("rollout.engine",))
    except ConfigError as e:
        raise EvalError(str(e)) from None
    from areal.services.evaluation import Evaluator
    from workers.rollout import prepare

    try:
        parts = prepare(s, f"eval-{Path(req.model_dir).name}")
    except (ValueError, OSError, ImportError) as e:  # a held-out set that does not build
        raise EvalError(f"{type(e).__name__}: {e}") from None
    plan = parts.eval_plan
    items = plan.items if req.data is not None or req.limit is None else plan.items[: req.limit]
    bar = _correct_at(s, req)
    greedy_plan = replace(plan, items=items, params=replace(plan.params, temperature=0.0))
    greedy, texts, rewards = _round(Evaluator(greedy_plan), parts)
    report: dict[str, Any] = {
        "model_dir": str(req.model_dir),
        "held_out": _held_out_name(s),
        "n_items": len(items),
        "reward_fn": plan.reward_fn,
        "engine": s.rollout.engine,
        "max_new_tokens": plan.params.max_new_tokens,
        "correct_at": bar,
        "greedy": {
            "accuracy": sum(r >= bar for r in rewards) / len(items),
            "mean_reward": greedy["eval_reward"],
            **{k: greedy[k] for k in ("errors", "gen_len_mean", "truncated_frac", "eval_s")},
        },
        "sampled": None,
        "items": [
            {
                "prompt": parts.decode_text(it.prompt_ids),
                "answer": it.answer,
                "greedy": text,
                "greedy_reward": r,
            }
            for it, text, r in zip(items, texts, rewards, strict=True)
        ],
    }
    if req.n:
        temperature = s.rollout.temperature if req.temperature is None else req.temperature
        sampled_plan = replace(
            greedy_plan,
            items=[it for it in items for _ in range(req.n)],  # item i's samples together
            params=replace(plan.params, temperature=temperature),
        )
        sampled, _, rewards = _round(Evaluator(sampled_plan), parts)
        correct = [
            sum(r >= bar for r in rewards[i : i + req.n]) for i in range(0, len(rewards), req.n)
        ]
        report["sampled"] = {
            "n": req.n,
            "temperature": temperature,
            "top_p": plan.params.top_p,
            **{f"pass@{k}": mean_pass_at_k(req.n, correct, k) for k in ks},
            "mean_reward": sampled["eval_reward"],
            **{k: sampled[k] for k in ("errors", "gen_len_mean", "truncated_frac", "eval_s")},
        }
        for row, c in zip(report["items"], correct, strict=True):
            row["n_correct"] = c
    close = getattr(parts.engine, "close", None)
    if callable(close):
        close()
    return report


def _held_out_name(s: RunSettings) -> str:
    d = s.data
    if d.eval_source is not None:
        split = f" (split {d.eval_split})" if d.eval_source.startswith("hf:") else ""
        return f"{d.eval_source}{split}"
    return (
        f"the held-out set of {d.source} (data.eval_size {d.eval_size}, split seed {d.split_seed})"
    )


def format_report(report: dict[str, Any]) -> str:
    """The table `areal eval` prints."""
    head = (
        f"areal eval {report['model_dir']}: {report['n_items']} items of {report['held_out']}; "
        f"reward {report['reward_fn']} (correct at >= {report['correct_at']:g}), "
        f"engine {report['engine']}, max {report['max_new_tokens']} new tokens"
    )
    rows = [("", "score", "mean reward", "gen len", "truncated", "errors")]
    g = report["greedy"]
    rows.append(_row("greedy accuracy", g["accuracy"], g))
    sampled = report["sampled"]
    if sampled is not None:
        how = f"n={sampled['n']}, T={sampled['temperature']:g}"
        ks = [key for key in sampled if key.startswith("pass@")]
        for i, key in enumerate(ks):
            if i == 0:
                rows.append(_row(f"{key} ({how})", sampled[key], sampled))
            else:
                rows.append((f"{key} ({how})", f"{sampled[key]:.4f}", "", "", "", ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join([head, *lines])


def _row(label: str, score: float, m: dict[str, Any]) -> tuple[str, ...]:
    return (
        label,
        f"{score:.4f}",
        f"{m['mean_reward']:.4f}",
        f"{m['gen_len_mean']:.1f}",
        f"{m['truncated_frac']:.3f}",
        str(m["errors"]),
    )


def run(req: EvalRequest, out: str | None) -> dict[str, Any]:
    """Evaluate, print the table, write the JSON report to `out` (when given)."""
    report = evaluate_model(req)
    print(format_report(report))
    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        print(f"report: {path}")
    return report


# --- the command line (`areal eval`; light imports only, so --help is instant) ----------------


def _ks(text: str) -> tuple[int, ...]:
    import argparse

    try:
        ks = tuple(int(k) for k in text.split(",") if k.strip())
    except ValueError:
        ks = ()
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"--k {text!r}: expected e.g. 1,4 (positive integers)")
    return tuple(sorted(set(ks)))


def add_eval_command(sub: Any) -> None:
    """`areal eval MODEL_DIR [--config RUN_CONFIG] [--data SPEC] [--reward FN] ...`."""
    e = sub.add_parser(
        "eval",
        help="score a model dir on a held-out set: greedy accuracy and sampled pass@k, with "
        "the prompts, chat template and reward of a run (the in-run evaluation's code)",
        description="Greedy accuracy and sampled pass@k of MODEL_DIR on a held-out set: the "
        "config's (data.eval_size / data.eval_source) or --data. Prompts, chat template, "
        "reward and engine settings come from --config (a run YAML or a run dir's config.json; "
        "default: the built-in defaults). Prints a table; --out writes the JSON report.",
        epilog="examples: areal eval runs/arithmetic/final --config runs/arithmetic/config.json"
        "  |  areal eval MODEL --data hf:DIR --split test --reward math --n 8 --k 1,4,8",
    )
    e.add_argument("model_dir", help="a Hugging Face model dir (e.g. a run's <out>/final)")
    e.add_argument("--config", help="run config: examples/<name>.yaml or <out>/config.json")
    e.add_argument(
        "--data",
        metavar="SPEC",
        help="held-out source (any data.source form: .jsonl, .parquet, hf:..., synthetic:... "
        "with --limit); default: the config's held-out set",
    )
    e.add_argument("--split", help="split of an hf: --data (default: data.eval_split, test)")
    e.add_argument("--reward", metavar="FN", help="reward.fn (default: the config's / task's)")
    e.add_argument("--engine", choices=["torch", "vllm"], help="default: rollout.engine")
    e.add_argument(
        "--n", type=int, default=0, help="samples per item for pass@k (default 0: greedy only)"
    )
    e.add_argument("--k", type=_ks, default=(), metavar="K[,K...]", help="default: 1 and --n")
    e.add_argument(
        "--temperature", type=float, help="sampling temperature (default: rollout.temperature)"
    )
    e.add_argument("--max-new-tokens", type=int, help="default: eval.max_new_tokens")
    e.add_argument("--limit", type=int, help="evaluate the first N held-out items only")
    e.add_argument(
        "--correct-at",
        type=float,
        metavar="R",
        help="a sample is correct when its reward >= R (default: the scorer's top, 1)",
    )
    e.add_argument("--out", metavar="FILE", help="write the JSON report here")
    e.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    e.set_defaults(fn=cmd_eval)


def cmd_eval(args: Any) -> int:
    import sys

    from areal.logging import setup_logging

    req = EvalRequest(
        model_dir=args.model_dir,
        config=args.config,
        data=args.data,
        split=args.split,
        reward=args.reward,
        engine=args.engine,
        n=args.n,
        ks=args.k,
        temperature=args.temperature,
        max_new_tokens=args.max_new_tokens,
        limit=args.limit,
        correct_at=args.correct_at,
        overrides=tuple(args.overrides),
    )
    setup_logging(level="WARNING", log_format="console", role="eval")
    try:
        run(req, args.out)
    except EvalError as e:
        print(f"areal eval: {e}", file=sys.stderr)
        return 2
    return 0
