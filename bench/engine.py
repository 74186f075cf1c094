"""Engine benchmark: continuous batching vs HF generate, FFD packing vs fixed micro-batches,
shared prompts on vs off.

(a) Inference on a LONG-TAILED batch: 64 prompts (8-24 random tokens) on a randomly initialised
    built-in tiny Qwen2 (`build_tiny_model`, context widened to 1024), no stop token, and a
    per-request generation length drawn from a log-normal (median 48, sigma 1.0, clipped to
    [4, 900]). `TorchInferenceEngine.generate` vs `transformers` `model.generate` (sampling,
    T = 1, top_p = 1, top_k off, same weights, same left-padded prompts). HF has one
    `max_new_tokens` per call, so it gets the batch max; both are credited only with the useful
    tokens (each request's own length). Our engine gets each request's length as
    `GenRequest.max_new_tokens` (the row leaves the batch as soon as it has its tokens). A
    uniform batch (every request the same length) is the control.
(b) Training: `TorchTrainEngine.train_step` on 64 long-tailed sequences (same length law,
    prompt 16) with `packing="ffd"` (dynamic micro-batches under `max_tokens_per_mb`,
    padding-free) vs `packing="fixed"` (consecutive chunks of `fixed_mb_size`, right-padded);
    tokens/s = real tokens / step time (the step includes the proximal log-prob pass), padding
    from the step's `padding_frac`.
(c) Training with shared prompts: GRPO-shaped batches (16 prompts x 8 samples, short and long
    prompts), `train_step` with `share_prompts` on vs off (a group's prompt run once per
    micro-batch vs once per sample).

    python bench/engine.py [--quick]

One torch thread (on a shared 2-core box two threads made the tiny model ~80x slower); every
number is the median of repeats (best in brackets). Writes engine.md and .png to the
results dir (bench/_common.py).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # bench/_common.py, the repo

from _common import RESULTS_DIR, machine_header, md_table, median, write_result  # noqa: E402

from areal.data.tiny_model import TINY_PRESET, build_tiny_model  # noqa: E402

N_REQUESTS = 64
CONTEXT = 1024


def long_tailed_lengths(n: int, rng: np.random.Generator, hi: int) -> list[int]:
    return [int(x) for x in np.clip(np.round(rng.lognormal(np.log(48), 1.0, n)), 4, hi)]


def dist(lengths: list[int]) -> str:
    a = np.asarray(lengths)
    return (
        f"min {a.min()}, median {int(np.median(a))}, mean {a.mean():.0f}, "
        f"p90 {int(np.percentile(a, 90))}, max {a.max()} (sum {a.sum()})"
    )


# ------------------------------------------------------------------------------- inference
def run_ours(engine, prompts: list[list[int]], targets: list[int]) -> tuple[float, int]:
    """(seconds, useful tokens) of one `generate` over the batch, per-request lengths native."""
    from areal.engines.base import GenRequest, SamplingParams

    assert engine.max_batch_size >= len(prompts)  # every row is prefilled at the first boundary
    reqs = [
        GenRequest(key=f"r{i}", prompt_ids=p, max_new_tokens=t)
        for i, (p, t) in enumerate(zip(prompts, targets, strict=True))
    ]
    params = SamplingParams(max_new_tokens=max(targets), temperature=1.0, top_p=1.0)
    t0 = time.perf_counter()
    outs = engine.generate(reqs, params=params)
    dt = time.perf_counter() - t0
    got = [len(o.output_ids) for o in outs]
    if got != list(targets):
        raise RuntimeError(f"per-request lengths off: {got[:8]} vs {targets[:8]}")
    return dt, sum(got)


def run_hf(model, prompts: list[list[int]], targets: list[int], pad_id: int) -> tuple[float, int]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attn[i, width - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=attn,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max(targets),
            min_new_tokens=max(targets),
            eos_token_id=None,
            pad_token_id=pad_id,
        )
    dt = time.perf_counter() - t0
    assert out.shape[1] - width == max(targets), out.shape
    return dt, sum(targets)  # useful tokens only: each request's own length


def bench_inference(model_dir: Path, reps: int, rng: np.random.Generator, vocab: int) -> dict:
    from transformers import AutoModelForCausalLM

    from areal.engines.config import InferenceEngineConfig
    from areal.engines.torch_infer import TorchInferenceEngine

    prompts = [rng.integers(3, vocab, int(rng.integers(8, 25))).tolist() for _ in range(N_REQUESTS)]
    hi = CONTEXT - 25 - 100
    tailed = long_tailed_lengths(N_REQUESTS, rng, hi)
    uniform = [int(np.mean(tailed))] * N_REQUESTS
    engine = TorchInferenceEngine(
        InferenceEngineConfig(
            kind="torch", model_path=str(model_dir), max_batch_size=N_REQUESTS, seed=0
        )
    )
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    hf.eval()
    torch.manual_seed(0)
    res = {}
    for name, targets in (("long-tailed", tailed), ("uniform", uniform)):
        r = {"targets": targets, "ours": [], "hf": []}
        run_ours(engine, prompts[:8], [4] * 8)  # warm-up
        run_hf(hf, prompts[:8], [4] * 8, 0)
        for rep in range(reps):
            for who in interleaved(rep, "ours", "hf"):
                if who == "ours":
                    dt, n = run_ours(engine, prompts, targets)
                else:
                    dt, n = run_hf(hf, prompts, targets, 0)
                r[who].append(n / dt)
                print(f"  {name:<11} rep {rep} {who:<4} {n / dt:8.0f} useful tok/s ({dt:.2f} s)")
        res[name] = r
    return res


# ------------------------------------------------------------------------------- training
def random_seq(prompt: torch.Tensor, n: int, rng: np.random.Generator, vocab: int):
    """A training sequence of `n` random output tokens after `prompt`, sampled (as far as its
    log-probs say) uniformly, with a random +-1 advantage."""
    from areal.engines.base import TrainSeq

    return TrainSeq(
        prompt_ids=prompt,
        output_ids=torch.as_tensor(rng.integers(3, vocab, n)),
        behav_logp=torch.full((n,), -float(np.log(vocab))),
        versions=torch.zeros(n, dtype=torch.long),
        adv=float(rng.choice([-1.0, 1.0])),
    )


def interleaved(rep: int, a, b) -> tuple:
    """The two arms in alternating order, so neither always runs first (warmer caches)."""
    return (a, b) if rep % 2 == 0 else (b, a)


def bench_training(model_dir: Path, reps: int, rng: np.random.Generator, vocab: int) -> dict:
    from areal.engines.config import TrainEngineConfig
    from areal.engines.torch_train import TorchTrainEngine

    prompt_len = 16
    outs = long_tailed_lengths(N_REQUESTS, rng, CONTEXT - prompt_len)
    seqs = [
        random_seq(torch.as_tensor(rng.integers(3, vocab, prompt_len)), n, rng, vocab) for n in outs
    ]
    max_tokens_per_mb, fixed_mb_size, n_minibatches = 4096, 8, 2  # the TrainSettings defaults
    res = {"lengths": [prompt_len + n for n in outs], "cfg": (max_tokens_per_mb, fixed_mb_size)}
    engines = {
        p: TorchTrainEngine(
            TrainEngineConfig(
                kind="torch",
                model_path=str(model_dir),
                packing=p,
                fixed_mb_size=fixed_mb_size,
                n_minibatches=n_minibatches,
                lr=1e-5,
            )
        )
        for p in ("ffd", "fixed")
    }
    for p, eng in engines.items():
        eng.train_step([replace(s) for s in seqs[:8]], max_tokens_per_mb)  # warm-up
        res[p] = {"tok_s": [], "padding_frac": [], "n_mb": [], "time_s": []}
    for rep in range(reps):
        for p in interleaved(rep, "ffd", "fixed"):
            st = engines[p].train_step([replace(s) for s in seqs], max_tokens_per_mb)
            r = res[p]
            r["tok_s"].append(st["tokens"] / st["time_s"])
            r["padding_frac"].append(st["padding_frac"])
            r["n_mb"].append(st["n_microbatches"])
            r["time_s"].append(st["time_s"])
            print(
                f"  train {p:<5} rep {rep}: {r['tok_s'][-1]:7.0f} tok/s, "
                f"padding {st['padding_frac']:.1%}, {st['n_microbatches']:.0f} micro-batches, "
                f"{st['time_s']:.2f} s"
            )
    return res


SHARED_SHAPES = {  # name -> (prompt tokens, output tokens low, high); 16 prompts x 8 samples
    "short prompts (6), outputs 1-6": (6, 1, 6),
    "long prompts (64), outputs 8-64": (64, 8, 64),
}


def bench_shared_prompts(model_dir: Path, reps: int, rng: np.random.Generator, vocab: int) -> dict:
    """(c) GRPO-shaped batches (16 prompts x 8 samples): `share_prompts` on vs off."""
    from areal.engines.config import TrainEngineConfig
    from areal.engines.torch_train import TorchTrainEngine

    engines = {
        on: TorchTrainEngine(
            TrainEngineConfig(
                kind="torch", model_path=str(model_dir), n_minibatches=2, lr=1e-5, share_prompts=on
            )
        )
        for on in (True, False)
    }
    res: dict = {}
    for name, (p, lo, hi) in SHARED_SHAPES.items():
        seqs = []
        for _ in range(16):
            prompt = torch.as_tensor(rng.integers(3, vocab, p))
            for _ in range(8):
                seqs.append(random_seq(prompt.clone(), int(rng.integers(lo, hi + 1)), rng, vocab))
        outs = sum(len(x.output_ids) for x in seqs)
        res[name] = {"tokens": {True: 16 * p + outs, False: 128 * p + outs}, True: [], False: []}
        for eng in engines.values():
            eng.train_step([replace(x) for x in seqs[:16]], 4096)  # warm-up
        for rep in range(reps):
            for on in interleaved(rep, True, False):
                st = engines[on].train_step([replace(x) for x in seqs], 4096)
                res[name][on].append(st["time_s"])
                print(f"  shared prompts {on!s:<5} {name}, rep {rep}: {st['time_s']:.3f} s")
    return res


# ------------------------------------------------------------------------------- report
def plot(path: Path, inf: dict, train: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a0, a1, a2) = plt.subplots(1, 3, figsize=(14, 4))
    a0.hist(inf["long-tailed"]["targets"], bins=30, color="gray")
    a0.set_title("long-tailed generation lengths (64 requests)")
    a0.set_xlabel("tokens")
    names = list(inf)
    x = np.arange(len(names))
    ours = [median(inf[n]["ours"]) for n in names]
    hf = [median(inf[n]["hf"]) for n in names]
    a1.bar(x - 0.2, ours, 0.4, label="TorchInferenceEngine")
    a1.bar(x + 0.2, hf, 0.4, label="HF model.generate")
    for i in range(len(names)):
        a1.text(x[i] - 0.2, ours[i], f"{ours[i] / hf[i]:.2f}x", ha="center", va="bottom")
    a1.set_xticks(x, names)
    a1.set_ylabel("useful generated tokens / s")
    a1.set_title("Inference (tiny model, CPU, 1 thread)")
    a1.legend()
    modes = ["ffd", "fixed"]
    tok = [median(train[m]["tok_s"]) for m in modes]
    pad = [median(train[m]["padding_frac"]) for m in modes]
    bars = a2.bar(modes, tok, color=["C2", "C3"])
    for b, p in zip(bars, pad, strict=True):
        a2.text(b.get_x() + b.get_width() / 2, b.get_height(), f"pad {p:.0%}", ha="center")
    a2.set_ylabel("real tokens / s (train_step)")
    a2.set_title("Training micro-batching")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repeat of each measurement")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    reps = args.reps or (1 if args.quick else 5)
    rng = np.random.default_rng(args.seed)
    header = machine_header(
        {
            "model": f"random tiny Qwen2 ({TINY_PRESET.num_hidden_layers} layers, hidden "
            f"{TINY_PRESET.hidden_size}, char vocab), context {CONTEXT}, float32, CPU",
            "repeats": f"{reps} (median; best in brackets), engines alternate order per repeat",
        }
    )
    print("# Engine benchmark\n\n" + header + "\n", flush=True)
    with tempfile.TemporaryDirectory(prefix="areal-bench-engine-") as tmp:
        model_dir = build_tiny_model(
            Path(tmp) / "tiny",
            seed=args.seed,
            preset=replace(TINY_PRESET, max_position_embeddings=CONTEXT),
        )
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(str(model_dir)).vocab_size
        print("inference ...", flush=True)
        inf = bench_inference(model_dir, reps, rng, vocab)
        print("training ...", flush=True)
        train = bench_training(model_dir, reps, rng, vocab)
        print("shared prompts ...", flush=True)
        shared = bench_shared_prompts(model_dir, reps, rng, vocab)

    rows = []
    for name, r in inf.items():
        o, h = median(r["ours"]), median(r["hf"])
        rows.append(
            [
                name,
                dist(r["targets"]),
                f"{o:.0f} ({max(r['ours']):.0f})",
                f"{h:.0f} ({max(r['hf']):.0f})",
                f"**{o / h:.2f}x**",
            ]
        )
    inf_table = md_table(
        [
            "batch (64 requests)",
            "generation lengths",
            "ours useful tok/s",
            "HF generate useful tok/s",
            "ours / HF",
        ],
        rows,
    )
    mtpm, fms = train["cfg"]
    rows = []
    for p, label in (("ffd", f"ffd, max_tokens_per_mb {mtpm}"), ("fixed", f"fixed, {fms} seqs/mb")):
        r = train[p]
        rows.append(
            [
                label,
                f"{median(r['tok_s']):.0f} ({max(r['tok_s']):.0f})",
                f"{median(r['padding_frac']):.1%}",
                f"{median(r['n_mb']):.0f}",
                f"{median(r['time_s']):.2f}",
            ]
        )
    speedup = median(train["ffd"]["tok_s"]) / median(train["fixed"]["tok_s"])
    train_table = md_table(
        ["packing", "real tokens/s", "padding_frac", "micro-batches / step", "step s"], rows
    )
    rows = []
    for name, r in shared.items():
        on, off = median(r[True]), median(r[False])
        rows.append(
            [
                name,
                f"{r['tokens'][True]} / {r['tokens'][False]}",
                f"{on:.3f} ({min(r[True]):.3f})",
                f"{off:.3f} ({min(r[False]):.3f})",
                f"**{off / on:.2f}x**",
            ]
        )
    shared_table = md_table(
        [
            "batch (16 prompts x 8 samples)",
            "tokens run, on / off",
            "step s, on",
            "step s, off",
            "speed-up",
        ],
        rows,
    )
    text = (
        "## (a) Inference: continuous batching vs HF generate\n\n"
        "Useful tokens = each request's own length, for both engines (HF decodes every row to "
        "the batch max). Ours: `TorchInferenceEngine.generate`, `max_batch_size` 64, each "
        "request's length given as `GenRequest.max_new_tokens`.\n\n"
        + inf_table
        + "\n\nPer-request lengths: each row finishes with reason `length` once it has its own "
        "`max_new_tokens` and leaves the batch before its last token is fed (checked: every "
        "output has exactly its target length); HF `generate` takes one `max_new_tokens` per "
        "call, so it decodes every row to the batch max."
        + "\n\n## (b) Training: dynamic micro-batching vs fixed micro-batches\n\n"
        f"64 sequences (prompt 16 + output), lengths {dist(train['lengths'])}; "
        "`TorchTrainEngine.train_step` (n_minibatches 2, proximal log-prob recompute "
        f"included). ffd / fixed tokens/s: **{speedup:.2f}x**.\n\n"
        + train_table
        + "\n"
        + "\n## (c) Training: shared prompts (`train.share_prompts`) on vs off\n\n"
        "GRPO-shaped batches: 16 random prompts, 8 samples each (output lengths uniform in the "
        "range), one `train_step` (n_minibatches 2, ffd, max_tokens_per_mb 4096). On, each "
        "prompt goes through the model once per micro-batch, not once per sample; the log-probs "
        "and gradients are the same (tests/unit/engines/test_torch_train.py).\n\n"
        + shared_table
        + "\n"
    )
    print(text, flush=True)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    plot(RESULTS_DIR / "engine.png", inf, train)
    path = write_result(
        "engine.md",
        "# Engine benchmark\n\n" + header + "\n\n" + text + "\n![engine](engine.png)\n",
    )
    print(f"wrote {path} and {RESULTS_DIR / 'engine.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
