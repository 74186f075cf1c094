"""CPU seconds of each process of a local run, by role: where a run's cores go.

Runs a command (an `areal run ...`), samples /proc every 0.25 s while it runs, and prints the
user + system CPU seconds each process had used when last seen, summed per role: each worker
by its `--worker-id`, the embedded nats-server, the launcher, and multiprocessing children
(the reward worker's scoring pool). A process that exits between two samples loses at most its
last 0.25 s. Linux only.

With `--steps A:B` before the command (which must then name its `--out`), it also prints what
each role used between the samples at which the run's `metrics.jsonl` first showed step A and
step B: the steady state, without start-up (imports, warm start, the first batch) and the
final checkpoint, as cores (CPU seconds over that window's wall seconds).

    python bench/cpu_by_process.py [--steps 10:50] areal run examples/arithmetic.yaml \
        --out /tmp/q --overwrite
"""

from __future__ import annotations

import collections
import json
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


def latest_step(metrics: str, since: float = 0.0) -> int:
    """The highest step `metrics.jsonl` records so far (0 before the first, and while the file
    is one last written before `since`, wall clock: an earlier run's, before `--overwrite`)."""
    step = 0
    try:
        if os.stat(metrics).st_mtime < since:
            return 0
        with open(metrics) as f:
            for line in f:
                try:
                    step = max(step, int(json.loads(line).get("step", 0)))
                except (ValueError, AttributeError):  # a line being written
                    continue
    except OSError:
        pass
    return step


def by_role(seen: dict[tuple[str, int], float]) -> collections.Counter[str]:
    out: collections.Counter[str] = collections.Counter()
    for (role, _), cpu_s in seen.items():
        out[role] += cpu_s
    return out


def parse_window(argv: list[str]) -> tuple[tuple[int, int] | None, str | None, list[str]]:
    """`--steps A:B` (if first), the command's `--out` (then required), and the command."""
    if not argv or argv[0] != "--steps":
        return None, None, argv
    try:
        a, b = (int(x) for x in argv[1].split(":"))
    except (IndexError, ValueError):
        raise SystemExit("--steps takes A:B, two step numbers (e.g. --steps 10:50)") from None
    if not 0 <= a < b:
        raise SystemExit(f"--steps {a}:{b}: needs 0 <= A < B")
    cmd = argv[2:]
    if "--out" not in cmd[:-1]:
        raise SystemExit("--steps needs the command's --out (where metrics.jsonl is written)")
    return (a, b), os.path.join(cmd[cmd.index("--out") + 1], "metrics.jsonl"), cmd


def main(argv: list[str]) -> int:
    window, metrics, argv = parse_window(argv)
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    seen: dict[tuple[str, int], float] = {}
    marks: dict[int, tuple[float, dict[tuple[str, int], float]]] = {}
    t0, started = time.monotonic(), time.time()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None:
        sample(seen)
        if window is not None and metrics is not None and len(marks) < 2:
            step = latest_step(metrics, since=started)
            for mark in window:
                if step >= mark and mark not in marks:
                    marks[mark] = (time.monotonic(), dict(seen))
        time.sleep(0.25)
    wall = time.monotonic() - t0
    roles = by_role(seen)
    print("| process | CPU s | share |\n|---|---|---|")
    total = sum(roles.values())
    for role, cpu_s in roles.most_common():
        print(f"| {role} | {cpu_s:.1f} | {cpu_s / total:.0%} |")
    print(f"| all | {total:.1f} | {total / wall:.2f} cores over {wall:.1f} s |")
    if window is not None:
        a, b = window
        if a not in marks or b not in marks or marks[b][0] <= marks[a][0]:
            print(f"\nsteps {a}:{b}: the run did not show both steps while it ran")
            return proc.returncode or 1
        (ta, at_a), (tb, at_b) = marks[a], marks[b]
        span = tb - ta
        used = by_role({k: v - at_a.get(k, 0.0) for k, v in at_b.items()})
        print(f"\nsteps {a} to {b} ({span:.1f} s of wall time):\n")
        print("| process | CPU s | cores |\n|---|---|---|")
        for role, cpu_s in used.most_common():
            print(f"| {role} | {cpu_s:.1f} | {cpu_s / span:.2f} |")
        print(f"| all | {sum(used.values()):.1f} | {sum(used.values()) / span:.2f} |")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
