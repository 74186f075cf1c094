"""Weights benchmark: publishing and fetching billion-parameter weights, beside the machine's bounds.

For synthetic bf16 state dicts of the shapes of Qwen2.5-0.5B (~0.92 GiB) and Qwen2.5-1.5B
(~2.9 GiB), random values, nothing downloaded, through both transports (the JetStream object
store of a private `EmbeddedNats`, and `file://` under a weights dir), with 1, 2 and 4 rollout
fetchers, each in its own process:
- publish: `Bus.put_weights` of a `SafetensorsBlob` (streamed, one tensor at a time), from
  start to stored + announced; MiB/s of the blob;
- all loaded: from the start of the publish until the last fetcher holds the weights verified
  (signature, size, SHA-256) and checked whole against the model spec (no NaN/inf);
- fetch MiB/s: per fetcher, from the announcement to the verified tensors (median);
- peak RSS: of the publisher and of each fetcher (VmHWM), and what streaming adds on top of
  what the process holds anyway (its state dict): `peak - (RSS before the transfer) - blob`
  for a fetcher, `peak - (RSS with the state dict built)` for the publisher; and the
  nats-server's peak RSS (VmHWM) over the whole run.
- the physical bounds, measured in the same run: memcpy (numpy copy of a 1 GiB array),
  loopback TCP (1 GiB through one 127.0.0.1 connection) and SHA-256 (every byte is hashed).

    python bench/weights.py [--quick] [--archs qwen2.5-0.5b,qwen2.5-1.5b] [--fetchers 1,2,4]

A case whose memory (blob x fetchers + the publisher's state dict, plus 25% and 0.5 GiB) is over
`--mem-budget-gib` (default 60% of the memory available at start) is skipped, the reason in the
table. `--quick`: a 64 MiB model, 1 and 2 fetchers, 256 MiB bounds (a smoke test).
No timing assertions: it prints a machine header and a markdown table, and writes
`weights[_quick].{md,json,png}` in the results dir (bench/_common.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # bench/_common.py, bench/_weights_parts.py, repo

from _weights_parts import (  # noqa: E402
    ARCHS,
    GIB,
    MIB,
    Case,
    loopback_tcp_gib_s,
    memcpy_gib_s,
    n_params,
    role_main,
    sha256_mib_s,
    vm_hwm_bytes,
)

HEADER = (
    "model",
    "masters→wire",
    "transport",
    "fetchers",
    "blob GiB",
    "publish s",
    "publish MiB/s",
    "all loaded s",
    "fetch MiB/s",
    "publisher RSS GiB (+stream MiB)",
    "fetcher RSS GiB (+stream MiB)",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="64 MiB model, 1 and 2 fetchers")
    ap.add_argument("--archs", default=None, help=f"comma list of {', '.join(ARCHS)}")
    ap.add_argument("--fetchers", default=None, help="comma list of fetcher counts")
    ap.add_argument("--transports", default="object_store,file")
    ap.add_argument("--no-fp32-case", action="store_true", help="skip fp32 masters -> bf16 wire")
    ap.add_argument(
        "--mem-budget-gib",
        type=float,
        default=None,
        help="skip a case needing more (default: 60%% of MemAvailable at start: the machine "
        "is shared)",
    )
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per case, a hang guard")
    ap.add_argument(
        "--out", type=Path, default=None, help="results dir (default: _common.RESULTS_DIR)"
    )
    ap.add_argument("--_role", nargs=2, help=argparse.SUPPRESS)  # publish|fetch CASE_JSON
    return ap.parse_args(argv)


def cases(args: argparse.Namespace) -> list[tuple[str, str, str, int]]:
    """(arch, masters, transport, fetchers), in run order."""
    archs = (args.archs or ("quick-64m" if args.quick else "qwen2.5-0.5b,qwen2.5-1.5b")).split(",")
    counts = [int(n) for n in (args.fetchers or ("1,2" if args.quick else "1,2,4")).split(",")]
    out = [(a, "bfloat16", t, n) for a in archs for t in args.transports.split(",") for n in counts]
    if not args.no_fp32_case:
        out.insert(1, (archs[0], "float32", args.transports.split(",")[0], 1))
    return out


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def _spawn(role: str, case: Case) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, "--_role", role, json.dumps(asdict(case))],
        stdout=subprocess.PIPE,
        text=True,
    )


def _read_line(proc: subprocess.Popen, tag: str) -> dict | None:
    """The first stdout line of `proc` starting with `tag` (its JSON, or None for no payload)."""
    for line in proc.stdout:
        if line.startswith(tag):
            rest = line[len(tag) :].strip()
            return json.loads(rest) if rest else None
    raise RuntimeError(f"{proc.args[3]} process exited ({proc.wait()}) before {tag}")


async def _declare(url: str, run_id: str, keys) -> None:
    from areal.bus.client import Bus

    bus = await Bus.connect(url, run_id, "trainer", "bench-declare", keys=keys)
    await bus.close()


async def _drop_bucket(url: str, run_id: str) -> None:
    """Free the case's object store (gigabytes on disk)."""
    from areal.bus.connection import connect
    from schemas.subjects import RunNames

    nc = await connect(url, "bench-cleanup")
    try:
        await nc.jetstream().delete_object_store(RunNames(run_id).weights_bucket)
    finally:
        await nc.close()


def run_case(url: str, keys_dir: str, keys, work: Path, spec: tuple, timeout_s: float) -> dict:
    arch, masters, transport, n = spec
    run_id = f"wb{uuid.uuid4().hex[:8]}"
    weights_dir = work / run_id
    weights_dir.mkdir()
    case = Case(
        url, run_id, keys_dir, str(weights_dir), arch, masters, "bfloat16", transport, timeout_s
    )
    asyncio.run(_declare(url, run_id, keys))
    fetchers = [_spawn("fetch", case) for _ in range(n)]
    try:
        for f in fetchers:
            _read_line(f, "READY")
        pub = _spawn("publish", case)
        published = _read_line(pub, "RESULT")
        fetched = [_read_line(f, "RESULT") for f in fetchers]
        for p in (pub, *fetchers):
            p.wait(timeout_s)
    finally:
        for p in fetchers:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(weights_dir, ignore_errors=True)
        if transport == "object_store":
            asyncio.run(_drop_bucket(url, run_id))
    return {
        "arch": arch,
        "masters": masters,
        "transport": transport,
        "fetchers": n,
        "publisher": published,
        "fetched": fetched,
    }


def summary(r: dict) -> dict:
    """The row's numbers (seconds, MiB/s, GiB) from one case's raw process reports."""
    p, fs = r["publisher"], r["fetched"]
    nbytes = p["nbytes"]
    fetch_rates = sorted(nbytes / MIB / (f["t_fetched"] - f["t_ann"]) for f in fs)
    return {
        "blob_gib": nbytes / GIB,
        "publish_s": p["t1"] - p["t0"],
        "publish_mib_s": nbytes / MIB / (p["t1"] - p["t0"]),
        "all_loaded_s": max(f["t_done"] for f in fs) - p["t0"],
        "fetch_mib_s_median": fetch_rates[len(fetch_rates) // 2],
        "check_s_max": max(f["t_done"] - f["t_fetched"] for f in fs),
        "publisher_peak_gib": p["peak_rss"] / GIB,
        "publisher_stream_mib": (p["peak_rss"] - p["base_rss"]) / MIB,
        "fetcher_peak_gib": max(f["peak_rss"] for f in fs) / GIB,
        "fetcher_stream_mib": max(f["peak_rss"] - f["base_rss"] - nbytes for f in fs) / MIB,
    }


def row(r: dict) -> list[object]:
    label = {"float32": "fp32→bf16", "bfloat16": "bf16→bf16"}[r["masters"]]
    head = [r["arch"], label, r["transport"].replace("object_store", "object store"), r["fetchers"]]
    if "skipped" in r:
        return [*head, "-", f"skipped: {r['skipped']}", *["-"] * (len(HEADER) - 6)]
    s = r["summary"]
    return [
        *head,
        f"{s['blob_gib']:.2f}",
        f"{s['publish_s']:.1f}",
        f"{s['publish_mib_s']:.0f}",
        f"{s['all_loaded_s']:.1f}",
        f"{s['fetch_mib_s_median']:.0f}",
        f"{s['publisher_peak_gib']:.2f} (+{s['publisher_stream_mib']:.0f})",
        f"{s['fetcher_peak_gib']:.2f} (+{s['fetcher_stream_mib']:.0f})",
    ]


def bounds(nbytes: int) -> dict[str, float]:
    return {
        "memcpy_gib_s": memcpy_gib_s(nbytes),
        "loopback_tcp_gib_s": loopback_tcp_gib_s(nbytes),
        "sha256_mib_s": sha256_mib_s(min(nbytes, 512 * MIB)),
    }


def plot(path: Path, results: list[dict], bound: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if "summary" in r and r["masters"] == "bfloat16"]
    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [
        f"{r['arch'].removeprefix('qwen2.5-')}\n{r['transport'][:6]} x{r['fetchers']}" for r in done
    ]
    xs = range(len(done))
    ax.bar(
        [x - 0.2 for x in xs],
        [r["summary"]["publish_mib_s"] for r in done],
        0.4,
        label="publish MiB/s",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [r["summary"]["fetch_mib_s_median"] for r in done],
        0.4,
        label="fetch MiB/s (median fetcher)",
    )
    ax.axhline(bound["loopback_tcp_gib_s"] * 1024, color="k", ls="--", label="loopback TCP")
    ax.axhline(bound["sha256_mib_s"], color="r", ls=":", label="SHA-256")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_yscale("log")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args._role:
        return role_main(*args._role)
    from _common import RESULTS_DIR, machine_header, md_table

    from areal.bus.embedded import EmbeddedNats
    from areal.security.keys import ensure_run_keys

    out_dir = args.out or RESULTS_DIR
    tag = "_quick" if args.quick else ""
    header = machine_header(
        {
            "models": ", ".join(
                f"{a} {n_params(ARCHS[a]) / 1e9:.2f}B params"
                for a in dict.fromkeys(c[0] for c in cases(args))
            ),
            "bus": "nats-server (EmbeddedNats, file storage), nats-py; every fetcher and the "
            "publisher in its own process, torch threads 1 each",
        }
    )
    print("# Weights benchmark\n\n" + header + "\n", flush=True)
    print("physical bounds ...", flush=True)
    bound = bounds(256 * MIB if args.quick else GIB)
    budget = int(args.mem_budget_gib * GIB) if args.mem_budget_gib else available_bytes() * 6 // 10
    results: list[dict] = []
    work = Path(tempfile.mkdtemp(prefix="areal-wbench-"))
    server = EmbeddedNats(store_dir=work / "nats").start()
    try:
        keys = ensure_run_keys(work / "keys")
        for spec in cases(args):
            arch, masters, _, n = spec
            blob = n_params(ARCHS[arch]) * 2
            held = n_params(ARCHS[arch]) * (4 if masters == "float32" else 2)
            need = int((blob * n + held) * 1.25) + GIB // 2
            print(f"case {spec} ...", flush=True)
            if need > min(budget, available_bytes()):
                reason = f"needs {need / GIB:.1f} GiB, budget {budget / GIB:.1f} GiB"
                results.append(
                    dict(
                        zip(("arch", "masters", "transport", "fetchers"), spec, strict=True),
                        skipped=reason,
                    )
                )
                continue
            r = run_case(server.url, str(work / "keys"), keys, work, spec, args.timeout_s)
            r["summary"] = summary(r)
            results.append(r)
            print("| " + " | ".join(str(c) for c in row(r)) + " |", flush=True)
        server_hwm = vm_hwm_bytes(server.proc.pid) if server.proc else 0
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    table = md_table(HEADER, [row(r) for r in results])
    bound_line = (
        f"Physical bounds, same run: memcpy {bound['memcpy_gib_s']:.1f} GiB/s, loopback TCP "
        f"{bound['loopback_tcp_gib_s']:.2f} GiB/s ({bound['loopback_tcp_gib_s'] * 1024:.0f} "
        f"MiB/s), SHA-256 {bound['sha256_mib_s']:.0f} MiB/s; nats-server peak RSS "
        f"{server_hwm / GIB:.2f} GiB."
    )
    text = f"# Weights benchmark\n\n{header}\n\n{table}\n\n{bound_line}\n"
    print("\n" + table + "\n\n" + bound_line, flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"weights{tag}.md").write_text(text)
    (out_dir / f"weights{tag}.json").write_text(
        json.dumps(
            {
                "bounds": bound,
                "nats_server_peak_rss": server_hwm,
                "results": results,
                "at": time.time(),
            },
            indent=1,
        )
    )
    plot(out_dir / f"weights{tag}.png", results, bound)
    print(f"wrote {out_dir / f'weights{tag}.md'}, .json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
