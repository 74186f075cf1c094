"""`cpu_affinity`: cpu lists, the config's checks, and processes started on their cores
(`child_setup` between fork and exec; the embedded nats-server, every thread of it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal.bus.embedded import EmbeddedNats
from areal.config import ConfigError, load_settings
from areal.launch.local import Launcher
from areal.proc import child_setup, format_cpu_list, parse_cpu_list

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "arithmetic.yaml"
linux_only = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="cpu affinity is Linux-only (sched_setaffinity)"
)


@pytest.mark.parametrize(
    ("text", "cpus", "canonical"),
    [
        ("0", {0}, "0"),
        ("1-3", {1, 2, 3}, "1-3"),
        ("0, 2-3", {0, 2, 3}, "0,2-3"),
        ("4,0-1,2", {0, 1, 2, 4}, "0-2,4"),
        ("5-5", {5}, "5"),
    ],
)
def test_cpu_lists_read_as_the_kernel_writes_them(text, cpus, canonical):
    assert parse_cpu_list(text) == cpus
    assert format_cpu_list(parse_cpu_list(text)) == canonical


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "not a cpu list"),
        ("1-", "not a cpu list"),
        ("a", "not a cpu list"),
        ("3-1", "runs backwards"),
        ("0,,1", "not a cpu list"),
        ("-1", "not a cpu list"),
    ],
)
def test_a_bad_cpu_list_says_what_is_wrong(text, why):
    with pytest.raises(ValueError, match=why):
        parse_cpu_list(text)


def test_the_config_takes_cores_per_role_and_other_for_the_rest():
    s = load_settings(EXAMPLE, ["cpu_affinity={rollout: 0, trainer: '1', other: 0-1}"])
    assert s.cpus_of("rollout") == {0} and s.cpus_of("trainer") == {1}
    assert s.cpus_of("nats") == s.cpus_of("reward") == {0, 1}  # "other"
    plain = load_settings(EXAMPLE, ["cpu_affinity.trainer=1"])
    assert plain.cpus_of("trainer") == {1} and plain.cpus_of("rollout") is None
    assert load_settings(EXAMPLE, []).cpus_of("trainer") is None  # default: nothing pinned


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("cpu_affinity={trainer: 1-}", "cpu_affinity.trainer: '1-' is not a cpu list"),
        ("cpu_affinity={gpu: 0}", "cpu_affinity.gpu"),  # not a process areal run starts
    ],
)
def test_a_bad_cpu_affinity_fails_at_load_naming_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(EXAMPLE, [override])


@linux_only
def test_cores_this_host_does_not_give_fail_the_launch_check(tmp_path):
    missing = max(os.sched_getaffinity(0)) + 1
    s = load_settings(EXAMPLE, [f"out_dir={tmp_path / 'o'}", f"cpu_affinity.rollout={missing}"])
    with pytest.raises(
        ConfigError, match=rf"cpu_affinity.rollout='{missing}' names cores {missing}"
    ):
        Launcher(s).check()
    assert not (tmp_path / "o").exists()  # nothing touched before every check passed
    here = format_cpu_list(os.sched_getaffinity(0))
    ok = load_settings(EXAMPLE, [f"out_dir={tmp_path / 'p'}", f"cpu_affinity.rollout={here}"])
    Launcher(ok).check()


@linux_only
def test_a_child_runs_on_its_cores_from_the_start():
    before = os.sched_getaffinity(0)
    core = min(before)
    probe = "import os; print(sorted(os.sched_getaffinity(0)))"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        preexec_fn=child_setup(frozenset({core})),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.strip() == f"[{core}]"
    assert os.sched_getaffinity(0) == before  # the parent's own cores are untouched


def _threads_cpus(pid: int) -> set[str]:
    lists = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                lists.add(line.split(":", 1)[1].strip())
    return lists


@linux_only
def test_the_embedded_server_and_every_thread_of_it_run_on_its_cores(tmp_path):
    core = max(os.sched_getaffinity(0))
    with EmbeddedNats(store_dir=tmp_path / "nats", cpus=frozenset({core})) as server:
        assert server.proc is not None
        assert _threads_cpus(server.proc.pid) == {str(core)}
