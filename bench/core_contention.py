"""Do this machine's cores slow each other down? The ceiling of overlapping two roles.

Async RL on 2 cores can at best run twice as fast as the synchronous schedule only if a core's
work does not slow down while the other core works too (two vCPUs can be SMT siblings of one
physical core, or share a memory bus that one job already fills). This runs the same
single-threaded torch job (a trainer-like MLP forward + backward, and a 512x512 matmul) on each
core alone, then on every core at once, and prints each core's rate both ways.

    python bench/core_contention.py [--iters 300] [--out DIR]

Writes <out>/core_contention.md.

A ratio of 1.00 means the cores are independent: the overlap ceiling is the core count.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]

from _common import RESULTS_DIR, machine_header, md_table  # noqa: E402


def _job(kind: str, core: int, iters: int, out: mp.Queue) -> None:
    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if kind == "matmul":
        a, b = torch.randn(512, 512), torch.randn(512, 512)

        def step() -> None:
            a @ b
    else:
        m = torch.nn.Sequential(
            torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)
        )
        x = torch.randn(256, 256)

        def step() -> None:
            m.zero_grad()
            m(x).pow(2).mean().backward()

    for _ in range(max(1, iters // 10)):  # warm up
        step()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    out.put((core, iters / (time.perf_counter() - t0)))


def rates(kind: str, cores: list[int], iters: int) -> dict[int, float]:
    """Iterations per second of the job on each of `cores`, all running at once."""
    q: mp.Queue = mp.Queue()
    procs = [mp.Process(target=_job, args=(kind, c, iters, q)) for c in cores]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300, help="timed iterations per job")
    ap.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"needs at least 2 cores, this process may use {cores}")
    rows = []
    for kind in ("mlp fwd+bwd", "matmul"):
        alone = {c: rates(kind, [c], args.iters)[c] for c in cores}
        together = rates(kind, cores, args.iters)
        for c in cores:
            ratio = together[c] / alone[c]
            rows.append([kind, str(c), f"{alone[c]:.1f}", f"{together[c]:.1f}", f"{ratio:.2f}"])
    cols = ["job", "core", "alone it/s", "all cores busy it/s", "ratio"]
    text = f"# Core contention\n\n{machine_header()}\n\n{md_table(cols, rows)}\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "core_contention.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
