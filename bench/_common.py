"""Helpers shared by the benchmarks: machine header, markdown tables, percentiles, repeats.

Benchmarks run on shared, small machines: every number is the median (or best) of repeats, and
the header says which machine, how many torch threads and which command produced it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def results_dir() -> Path:
    """Where a benchmark writes its report (.md, .json, .png) by default: outside the
    checkout, so a run leaves the work tree clean: `$AREAL_BENCH_RESULTS`, else
    `<AREAL_CACHE_DIR or ~/.cache/areal-bus>/bench-results`. To update the committed tables the
    docs cite: `AREAL_BENCH_RESULTS=bench/results python bench/<script>.py`."""
    if os.environ.get("AREAL_BENCH_RESULTS"):
        return Path(os.environ["AREAL_BENCH_RESULTS"]).resolve()
    cache = os.environ.get("AREAL_CACHE_DIR") or Path.home() / ".cache" / "areal-bus"
    return Path(cache) / "bench-results"


RESULTS_DIR = results_dir()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_header(extra: dict[str, str] | None = None) -> str:
    """Markdown bullet list: machine, load, torch threads, command."""
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    lines = [
        f"- machine: {os.cpu_count()} CPUs (nproc), {cpu_model()}, {platform.system()} "
        f"{platform.release()}, Python {platform.python_version()}",
        f"- torch {torch.__version__}, torch threads {torch.get_num_threads()}, "
        f"load average at start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}",
        f"- command: `{command_line()}`",
    ]
    for k, v in (extra or {}).items():
        lines.append(f"- {k}: {v}")
    return "\n".join(lines)


def command_line() -> str:
    script = os.path.relpath(sys.argv[0], REPO_ROOT)
    return "python " + " ".join(shlex.quote(a) for a in [script, *sys.argv[1:]])


def md_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank-with-interpolation percentile (q in [0, 100]) of a non-empty sequence."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def median_missed_last(values: Sequence[float | None]) -> float | None:
    """Median of times (or steps) to a target where None (never reached) counts as slower than
    any run that reached it; None when the median run itself never reached it (or no runs)."""
    m = statistics.median([math.inf if v is None else v for v in values]) if values else math.inf
    return None if m == math.inf else m


def write_result(name: str, text: str) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / name
    path.write_text(text)
    return path


def report(title: str, header: dict[str, str], table: str, summary: list[str]) -> str:
    """A benchmark's markdown report: title, machine header (with `header`), table, summary."""
    return "\n\n".join([f"# {title}", machine_header(header), table, "\n".join(summary)]) + "\n"


def write_report(stem: str, text: str, data: object) -> None:
    """`<stem>.md` (the report, also printed) and `<stem>.json` (`data`) in `RESULTS_DIR`."""
    md = write_result(f"{stem}.md", text)
    write_result(f"{stem}.json", json.dumps(data, indent=1))
    print(text)
    print(f"wrote {md}")


def git(*args: str, cwd: Path = REPO_ROOT) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


@contextlib.contextmanager
def code_trees(compare: str | None, tmpdir: Path) -> Iterator[dict[str, Path]]:
    """Name -> checkout to run: this tree, and with `compare` a git worktree of that revision
    (made under `tmpdir`, removed after), listed first. For a benchmark that runs two versions of
    the code side by side, interleaved, from one venv (each with its checkout first on
    PYTHONPATH)."""
    head = git("rev-parse", "--short", "HEAD") + (
        " + uncommitted" if git("status", "--short", "--untracked-files=no") else ""
    )
    codes = {f"this tree ({head})": REPO_ROOT}
    if not compare:
        yield codes
        return
    wt = tmpdir / "compare"
    git("worktree", "add", "--detach", str(wt), compare)
    try:
        yield {f"{compare} ({git('rev-parse', '--short', compare)})": wt, **codes}
    finally:
        git("worktree", "remove", "--force", str(wt))
