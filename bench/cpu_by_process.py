"""CPU seconds of each process of a local run, by role: where a run's cores go.

Runs a command (an `areal run ...`), samples /proc every 0.25 s while it runs, and prints the
user + system CPU seconds each process had used when last seen, summed per role: each worker
by its `--worker-id`, the embedded nats-server, the launcher, and multiprocessing children
(the reward worker's scoring pool). A process that exits between two samples loses at most its
last 0.25 s. Linux only.

    python bench/cpu_by_process.py areal run examples/arithmetic.yaml --out /tmp/q --overwrite
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def role_of(cmdline: str) -> str | None:
    if "--worker-id" in cmdline:
        return cmdline.split("--worker-id ")[1].split()[0]
    if "nats-server" in cmdline:
        return "nats-server"
    if "multiprocessing" in cmdline:
        return "multiprocessing children"
    if "areal run" in cmdline or "bin/areal run" in cmdline:
        return "launcher"
    return None


def sample(seen: dict[tuple[str, int], float]) -> None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        role = role_of(cmdline)
        if role is not None:  # utime + stime, fields 14 and 15 of stat
            seen[(role, int(pid))] = (int(fields[11]) + int(fields[12])) / TICK


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    seen: dict[tuple[str, int], float] = {}
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None:
        sample(seen)
        time.sleep(0.25)
    wall = time.monotonic() - t0
    by_role: collections.Counter[str] = collections.Counter()
    for (role, _), cpu_s in seen.items():
        by_role[role] += cpu_s
    print("| process | CPU s | share |\n|---|---|---|")
    total = sum(by_role.values())
    for role, cpu_s in by_role.most_common():
        print(f"| {role} | {cpu_s:.1f} | {cpu_s / total:.0%} |")
    print(f"| all | {total:.1f} | {total / wall:.2f} cores over {wall:.1f} s |")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
