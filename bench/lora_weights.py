"""LoRA weight sync against full weights: bytes, publish, fetch and rollout switch per version.

For each model shape (SmolLM2-135M, Qwen2.5-0.5B and -1.5B: synthetic bf16 tensors of their
names and shapes, random values, nothing downloaded) and each arm:
- full: the whole state dict, as a full-weights run publishes it;
- lora qkvo r16: the adapter of the default `train.lora` (r 16 on q/k/v/o_proj);
- lora all r16: r 16 on every linear layer of the decoder (q/k/v/o, gate/up/down);
one version goes through the real path of a run, in one process, on a private `EmbeddedNats`:
- publish: `Bus.put_weights` of the streamed `SafetensorsBlob` (signed, stored in the JetStream
  object store, announced);
- fetch: `Bus.fetch_weights` into a `SafetensorsSink` (signature, size and SHA-256 verified);
- switch: what the torch rollout engine's `load_weights` does with it on a live bf16 model of
  the shape: full weights `check_state_dict` (names, shapes, finiteness) and a copy into every
  tensor; an adapter `check_adapter` and `merge_adapter` (W = W0 + s B A from the pristine W0
  of the adapted weights; timed once warm, as every version after the first is).

    python bench/lora_weights.py [--archs smollm2-135m,qwen2.5-0.5b,qwen2.5-1.5b] [--reps 2]

Times are the median of `--reps` versions. No timing assertions: it prints a machine header
and a markdown table, and writes `lora_weights.{md,json,png}` in the results dir
(bench/_common.py). The goal it reports against: weight sync at least 50x cheaper per version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # bench/_common.py, bench/_weights_parts.py, repo

from _weights_parts import ARCHS, MIB, n_params, random_state  # noqa: E402

ARMS = {  # arm -> LoRA target modules (None: full weights)
    "full": None,
    "lora qkvo r16": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "lora all r16": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
}
RANK = 16
HEADER = (
    "model",
    "arm",
    "MiB / version",
    "publish s",
    "fetch s",
    "switch s",
    "sync s (sum)",
    "bytes vs full",
    "sync vs full",
)


def adapter(live: dict, targets: tuple[str, ...], fingerprint: str, seed: int) -> dict:
    """A random adapter (wire form, bf16) for the weights of `live` named by `targets`."""
    import torch

    from areal.engines.lora import ADAPTER_KEY, AdapterMeta

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, w in live.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in targets:
            out_f, in_f = w.shape
            out[f"{module}.lora_A.weight"] = torch.randn(RANK, in_f, generator=g).bfloat16()
            out[f"{module}.lora_B.weight"] = torch.randn(out_f, RANK, generator=g).bfloat16()
    meta = AdapterMeta(base=fingerprint, r=RANK, alpha=2.0 * RANK, target_modules=targets)
    out[ADAPTER_KEY] = meta.to_tensor()
    return out


async def one_arch(url: str, keys, arch: str, reps: int, version: list[int]) -> list[dict]:
    import torch

    from areal.bus.client import Bus
    from areal.engines.lora import base_fingerprint, check_adapter, merge_adapter
    from areal.engines.weights_check import check_state_dict, spec_of
    from areal.engines.weights_stream import SafetensorsBlob, SafetensorsSink

    run_id = f"lw{uuid.uuid4().hex[:8]}"
    pub = await Bus.connect(url, run_id, "trainer", "bench-trainer", keys=keys)
    sub_bus = await Bus.connect(url, run_id, "rollout", "bench-rollout", declare=False, keys=keys)
    announced: asyncio.Queue = asyncio.Queue()

    async def on_ann(ann) -> None:
        announced.put_nowait(ann)

    sub = await sub_bus.subscribe_weights(on_ann)
    live = random_state(ARCHS[arch], "bfloat16", seed=1)  # the rollout's model
    spec, fingerprint = spec_of(live), base_fingerprint(live)
    rows = []
    try:
        for arm, targets in ARMS.items():
            if targets is None:
                state = random_state(ARCHS[arch], "bfloat16", seed=2)  # the trainer's weights
            else:
                state = adapter(live, targets, fingerprint, seed=3)
            pristine: dict[str, torch.Tensor] = {}
            if targets is not None:  # warm: the first version fills the pristine copies
                merge_adapter(live, pristine, state)
            times: dict[str, list[float]] = {"publish": [], "fetch": [], "switch": []}
            nbytes = 0
            for _ in range(reps):
                version[0] += 1
                t0 = time.perf_counter()
                blob = SafetensorsBlob(state, None)
                await pub.put_weights(version[0], blob, "bfloat16", step=version[0])
                t1 = time.perf_counter()
                ann = await asyncio.wait_for(announced.get(), 600)
                got = (await sub_bus.fetch_weights(ann, SafetensorsSink)).state_dict()
                t2 = time.perf_counter()
                if targets is None:
                    check_state_dict(spec, got, what="bench weights")
                    with torch.no_grad():
                        for k, v in got.items():
                            live[k].copy_(v)
                else:
                    check_adapter(spec, fingerprint, got)
                    merge_adapter(live, pristine, got)
                t3 = time.perf_counter()
                nbytes = ann.nbytes
                times["publish"].append(t1 - t0)
                times["fetch"].append(t2 - t1)
                times["switch"].append(t3 - t2)
                del got
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"arch": arch, "arm": arm, "nbytes": nbytes, **med, "all": times})
            print(f"  {arch} {arm}: {nbytes / MIB:.1f} MiB, {med}", flush=True)
            del state
            if targets is not None:  # the next arm starts from the base again
                with torch.no_grad():
                    for k, w0 in pristine.items():
                        live[k].copy_(w0)
    finally:
        await sub.unsubscribe()
        await sub_bus.close()
        await pub.close()
    return rows


def table_rows(results: list[dict]) -> list[list[object]]:
    full = {r["arch"]: r for r in results if r["arm"] == "full"}
    out = []
    for r in results:
        f = full[r["arch"]]
        sync = r["publish"] + r["fetch"] + r["switch"]
        full_sync = f["publish"] + f["fetch"] + f["switch"]
        out.append(
            [
                r["arch"],
                r["arm"],
                f"{r['nbytes'] / MIB:.2f}",
                f"{r['publish']:.3f}",
                f"{r['fetch']:.3f}",
                f"{r['switch']:.3f}",
                f"{sync:.3f}",
                "1x" if r is f else f"{f['nbytes'] / r['nbytes']:.0f}x smaller",
                "1x" if r is f else f"{full_sync / sync:.0f}x faster",
            ]
        )
    return out


def plot(path: Path, results: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    archs = list(dict.fromkeys(r["arch"] for r in results))
    width = 0.8 / len(ARMS)
    for i, arm in enumerate(ARMS):
        rs = [next(r for r in results if r["arch"] == a and r["arm"] == arm) for a in archs]
        xs = [x + (i - 1) * width for x in range(len(archs))]
        axes[0].bar(xs, [r["nbytes"] / MIB for r in rs], width, label=arm)
        axes[1].bar(xs, [r["publish"] + r["fetch"] + r["switch"] for r in rs], width, label=arm)
    for ax, title in zip(axes, ("MiB per version", "sync s per version"), strict=True):
        ax.set_xticks(range(len(archs)), archs, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--archs", default="smollm2-135m,qwen2.5-0.5b,qwen2.5-1.5b")
    ap.add_argument("--reps", type=int, default=2, help="versions per arm (median reported)")
    ap.add_argument("--out", type=Path, default=None, help="results dir (default: _common's)")
    args = ap.parse_args(argv)
    import torch
    from _common import RESULTS_DIR, machine_header, md_table

    from areal.bus.embedded import EmbeddedNats
    from areal.security.keys import ensure_run_keys, load_run_keys

    torch.set_num_threads(1)
    archs = args.archs.split(",")
    header = machine_header(
        {
            "models": ", ".join(f"{a} {n_params(ARCHS[a]) / 1e9:.2f}B params" for a in archs),
            "path": "one process: Bus.put_weights (signed, JetStream object store of an "
            "EmbeddedNats) -> Bus.fetch_weights (verified) -> the torch rollout engine's "
            f"check and load (full) or check_adapter + merge_adapter (LoRA r {RANK}); bf16",
        }
    )
    print("# LoRA weight sync\n\n" + header + "\n", flush=True)
    work = Path(tempfile.mkdtemp(prefix="areal-lwbench-"))
    server = EmbeddedNats(store_dir=work / "nats").start()
    results: list[dict] = []
    try:
        ensure_run_keys(work / "keys")
        keys = load_run_keys(work / "keys", signing=True)
        version = [0]
        for arch in archs:
            print(f"{arch} ...", flush=True)
            results += asyncio.run(one_arch(server.url, keys, arch, args.reps, version))
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    table = md_table(HEADER, table_rows(results))
    goal = goal_line(results)
    text = f"# LoRA weight sync\n\n{header}\n\n{table}\n\n{goal}\n"
    print("\n" + table + "\n\n" + goal, flush=True)
    out_dir = args.out or RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "lora_weights.md").write_text(text)
    (out_dir / "lora_weights.json").write_text(
        json.dumps({"results": results, "at": time.time()}, indent=1)
    )
    plot(out_dir / "lora_weights.png", results)
    print(f"wrote {out_dir / 'lora_weights.md'}, .json and .png")
    return 0


def goal_line(results: list[dict]) -> str:
    """The default adapter against full weights, per shape: the 50x goal met or not."""
    parts = []
    for f in (r for r in results if r["arm"] == "full"):
        lo = next(r for r in results if r["arch"] == f["arch"] and r["arm"] == "lora qkvo r16")
        sync = lo["publish"] + lo["fetch"] + lo["switch"]
        ratio = (f["publish"] + f["fetch"] + f["switch"]) / sync
        parts.append(
            f"{f['arch']} {f['nbytes'] / lo['nbytes']:.0f}x fewer bytes, {ratio:.0f}x less time"
        )
    return "Goal, weight sync at least 50x cheaper per version (default adapter): " + "; ".join(
        parts
    )


if __name__ == "__main__":
    sys.exit(main())
