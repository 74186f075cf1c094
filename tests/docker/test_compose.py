"""docker-compose.yml, docker/Dockerfile and docker/k8s: static checks that need no daemon, and an
opt-in run of the real stack (skipped with the reason when no Docker daemon answers).

The static checks hold the files to what the README promises: every service runs a real `areal`
subcommand whose config validates, the NATS config path is the one `setup` writes, no host port
is published by default, and the Dockerfile installs dependencies before the source.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from areal.cli import WORKER_ROLES, build_parser
from areal.config import load_settings
from areal.launch.worker import parse_args

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
K8S = ROOT / "docker" / "k8s"
_VAR = re.compile(r"\$\{([A-Z0-9_]+)(?::-([^}]*))?\}")


def _subst(text: str) -> str:
    """Compose's `${VAR:-default}` with every variable unset: the defaults."""
    return _VAR.sub(lambda m: m.group(2) or "", text)


def compose(path: Path = COMPOSE) -> dict:
    return yaml.safe_load(_subst(path.read_text()))


def test_compose_builds_one_image_and_publishes_no_port():
    services = compose()["services"]
    assert set(services) == {
        "setup",
        "nats",
        "declare",
        "controller",
        "trainer",
        "rollout",
        "reward",
    }
    assert [n for n, s in services.items() if "build" in s] == ["setup"]
    image = services["setup"]["image"]
    assert all(services[r]["image"] == image for r in WORKER_ROLES)
    assert services["setup"]["build"]["dockerfile"] == "docker/Dockerfile"
    assert not any("ports" in s for s in services.values())
    ports = compose(ROOT / "docker" / "compose.ports.yml")["services"]["nats"]["ports"]
    assert ports and all(p.startswith("127.0.0.1:") for p in ports)


def test_compose_waits_for_setup_and_a_healthy_nats():
    services = compose()["services"]
    assert services["nats"]["depends_on"]["setup"]["condition"] == "service_completed_successfully"
    assert "js-enabled-only=true" in " ".join(services["nats"]["healthcheck"]["test"])
    deps = services["declare"]["depends_on"]  # the launcher's account declares the run
    assert deps["nats"]["condition"] == "service_healthy"
    assert deps["setup"]["condition"] == "service_completed_successfully"
    for role in WORKER_ROLES:  # no worker account may create streams: they wait for declare
        deps = services[role]["depends_on"]
        assert deps["declare"]["condition"] == "service_completed_successfully"
        assert "./runs:/app/runs" in services[role]["volumes"]  # outputs on the host


def test_every_command_is_a_real_subcommand_and_its_config_validates(monkeypatch):
    services = compose()["services"]
    env = services["trainer"]["environment"]
    for k, v in env.items():
        if v is not None:
            monkeypatch.setenv(k, str(v))
    config = _subst("${AREAL_CONFIG:-examples/arithmetic.yaml}")
    (mount,) = [v for v in services["trainer"]["volumes"] if isinstance(v, dict)]
    # the long form: `examples/x.yaml` without `./` is a path there, a volume name in `SRC:DST`
    assert mount == {
        "type": "bind",
        "source": config,
        "target": "/config/run.yaml",
        "read_only": True,
    }
    for role in WORKER_ROLES:
        cmd = services[role]["command"]
        assert cmd[:2] == ["worker", role]
        args = parse_args(role, cmd[2:])
        assert args.config == "/config/run.yaml"
    declare = build_parser().parse_args(services["declare"]["command"])
    assert declare.fn.__name__ == "cmd_declare" and declare.config == "/config/run.yaml"
    setup = services["setup"]["command"]
    args = build_parser().parse_args(setup)
    assert args.fn.__name__ == "cmd_prepare"
    settings = load_settings(ROOT / config, [])  # the file every service mounts, with its env
    assert settings.out_dir == f"/app/runs/{settings.run_id}"
    assert settings.nats.credentials_dir == args.nats_config  # setup writes what workers read
    conf = services["nats"]["command"][services["nats"]["command"].index("-c") + 1]
    assert conf == f"{args.nats_config}/nats-server.conf"


def test_gpu_override_reserves_a_gpu_for_trainer_and_rollout():
    services = compose(ROOT / "docker" / "compose.gpu.yml")["services"]
    for role in ("trainer", "rollout"):
        (dev,) = services[role]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
    assert services["setup"]["build"]["target"] == "cuda"
    # every service of the base file on the areal image gets the cuda one (declare included:
    # the cpu image is not built under this override)
    base = compose()["services"]
    on_areal = {n for n, s in base.items() if s["image"] == base["setup"]["image"]}
    assert on_areal == {"setup", "declare", *WORKER_ROLES}
    assert all(services[n]["image"] == "areal-bus:cuda" for n in on_areal)


def test_dockerfile_installs_dependencies_before_the_source():
    lines = [ln.strip() for ln in DOCKERFILE.read_text().splitlines()]
    targets = [ln.split()[-1] for ln in lines if ln.startswith("FROM ")]
    assert targets == ["cpu", "cuda"]
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in lines
    for start in (i for i, ln in enumerate(lines) if ln.startswith("FROM ")):
        stage = lines[start:]
        deps = next(
            i for i, ln in enumerate(stage) if "scripts/install.sh" in ln and "COPY" not in ln
        )
        source = next(i for i, ln in enumerate(stage) if ln.startswith("COPY areal"))
        assert deps < source
    assert "pip install -e" not in DOCKERFILE.read_text()
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*")] == "*" and "!areal" in ignore  # a whitelist: no .git, runs/


def test_k8s_manifests_parse_with_the_expected_kinds():
    kinds: dict[str, set[str]] = {}
    for f in sorted(K8S.rglob("*.yaml")):
        if f.name == "nats-values.yaml":
            values = yaml.safe_load(f.read_text())
            assert values["config"]["jetstream"]["enabled"] is True
            continue
        for doc in yaml.safe_load_all(f.read_text()):
            if doc and "kind" in doc:
                kinds.setdefault(doc["kind"], set()).add(doc["metadata"]["name"])
    assert {"rollout", "reward"} <= kinds["Deployment"]
    assert {"trainer", "controller"} <= kinds["StatefulSet"]
    assert "areal-run" in kinds["ConfigMap"]
    assert {"areal-prepare", "areal-declare"} <= kinds["Job"]
    assert {"controller", "trainer"} <= kinds["Service"]  # the StatefulSets' headless Services
    assert "Secret" not in kinds  # made from `areal nats-config` (passwords): test_manifests.py


def test_cluster_override_runs_three_routed_nodes_and_points_every_worker_at_them():
    base, over = compose(), compose(ROOT / "docker" / "compose.cluster.yml")["services"]
    nodes = ["nats", "nats-2", "nats-3"]
    assert set(over) == {*nodes, *WORKER_ROLES}
    conf = base["services"]["nats"]["command"][1]  # the accounts `setup` wrote, on every node
    routes = set()
    for i, n in enumerate(nodes):
        cmd = over[n]["command"]
        assert cmd[:2] == ["-c", conf]
        assert cmd[cmd.index("--server_name") + 1] == f"nats-{i + 1}"
        routes.add(cmd[cmd.index("--routes") + 1])
        assert "healthz" in " ".join(over[n]["healthcheck"]["test"])
        assert "ports" not in over[n]
    (route_list,) = routes  # one route list, naming every node
    assert sorted(r.split("//")[1].split(":")[0] for r in route_list.split(",")) == nodes
    for role in WORKER_ROLES:
        env = over[role]["environment"]
        urls = env["AREAL_NATS__URL"].split(",")
        assert sorted(u.split("//")[1].split(":")[0] for u in urls) == nodes
        assert env["AREAL_NATS__REPLICAS"] == "3"
        assert all(over[role]["depends_on"][n]["condition"] == "service_healthy" for n in nodes)
    settings = load_settings(
        ROOT / "examples" / "arithmetic.yaml",
        [f"nats.url={over['trainer']['environment']['AREAL_NATS__URL']}", "nats.replicas=3"],
    )
    assert settings.nats.replicas == 3 and settings.nats.url.count(",") == 2


# ------------------------------------------------------------------ `docker compose config`
def _compose_cli() -> str | None:
    """Why `docker compose config` cannot run here (it needs the CLI, not a daemon)."""
    if shutil.which("docker") is None:
        return "no docker CLI"
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        return "no `docker compose` (v2) plugin"
    return None


def _rendered(*files: Path, **env: str) -> dict:
    """`docker compose -f ... config` as compose itself resolves it (defaults, paths, merges)."""
    args = [a for f in files for a in ("-f", str(f))]
    r = subprocess.run(
        ["docker", "compose", *args, "config", "--format", "json"],
        env={k: v for k, v in os.environ.items() if not k.startswith("AREAL_")} | env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _config_sources(rendered: dict) -> dict[str, str]:
    """service -> the host path mounted at /config/run.yaml (bind mounts only)."""
    return {
        name: v["source"]
        for name, s in rendered["services"].items()
        for v in s.get("volumes", [])
        if v["target"] == "/config/run.yaml" and v["type"] == "bind"
    }


@pytest.mark.parametrize(
    "path",
    ["examples/running_sum.yaml", "./examples/running_sum.yaml", "ABS"],
    ids=["no-dot", "dot-slash", "absolute"],
)
def test_compose_mounts_the_run_config_by_any_path_form(path):
    if reason := _compose_cli():
        pytest.skip(reason)
    want = str(ROOT / "examples" / "running_sum.yaml")
    sources = _config_sources(_rendered(COMPOSE, AREAL_CONFIG=want if path == "ABS" else path))
    assert set(sources) == {"setup", "declare", *WORKER_ROLES}
    assert set(sources.values()) == {want}


def test_gpu_override_renders_the_config_the_cuda_image_and_the_gpus():
    if reason := _compose_cli():
        pytest.skip(reason)
    config = "examples/gpu/qwen2.5-1.5b-math.yaml"
    r = _rendered(COMPOSE, ROOT / "docker" / "compose.gpu.yml", AREAL_CONFIG=config)
    services = r["services"]
    assert set(_config_sources(r).values()) == {str(ROOT / config)}
    for name in ("setup", "declare", *WORKER_ROLES):
        assert services[name]["image"] == "areal-bus:cuda", name
    assert services["setup"]["build"]["target"] == "cuda"
    for name in ("trainer", "rollout"):
        (dev,) = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert dev["driver"] == "nvidia" and dev["capabilities"] == ["gpu"]
        assert int(dev["count"]) == 1  # AREAL_GPUS_PER_WORKER's default
    for name in ("controller", "reward", "declare", "setup"):
        assert "deploy" not in services[name]
    assert services["rollout"]["shm_size"]  # vLLM's weight hand-off through /dev/shm


# ------------------------------------------------------------------ opt-in: the real stack
def _docker_answers() -> str | None:
    if shutil.which("docker") is None:
        return "no docker CLI"
    r = subprocess.run(["docker", "info"], capture_output=True, text=True)
    if r.returncode != 0:
        return "no Docker daemon answers (`docker info` failed)"
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        return "no `docker compose` (v2) plugin"
    return None


def _summary(run_id: str) -> dict:
    return json.loads((ROOT / "runs" / run_id / "summary.json").read_text())


def _samples_by_replica(logs: str) -> dict[str, int]:
    """`docker compose logs rollout` -> samples each replica generated (its `rollout_stopped`
    line), for replicas that generated any."""
    got: dict[str, int] = {}
    for ln in logs.splitlines():
        # json (the image's AREAL_LOG_FORMAT) or console log lines
        if "rollout_stopped" in ln and (m := re.search(r'(?:"samples": |\bsamples=)(\d+)', ln)):
            replica = ln.split("|")[0].strip()
            got[replica] = got.get(replica, 0) + int(m[1])
    return {k: v for k, v in got.items() if v > 0}


def _scored_by_replica(logs: str) -> dict[str, dict[str, int]]:
    """`docker compose logs reward` -> each replica's `reward_stopped` counts."""
    got: dict[str, dict[str, int]] = {}
    for ln in logs.splitlines():
        replica, _, line = ln.partition("|")
        if '"reward_stopped"' in line:
            rec = json.loads(line.strip())
            got[replica.strip()] = {k: rec[k] for k in ("groups", "samples", "errors")}
    return got


def _project_leftovers(project: str) -> tuple[list[str], list[str]]:
    """Containers and volumes still labelled with the compose project."""
    label = f"label=com.docker.compose.project={project}"
    ps = ["docker", "ps", "-a", "--filter", label, "--format", "{{.Names}}"]
    vols = ["docker", "volume", "ls", "--filter", label, "--format", "{{.Name}}"]
    out = [subprocess.run(c, capture_output=True, text=True).stdout.split() for c in (ps, vols)]
    return out[0], out[1]


# `up --exit-code-from` implies `--abort-on-container-exit`: the one-shot services must not be
# attached, or the exit of the first ends the stack (docs/deploy/compose.md)
ONE_SHOT = ("--no-attach", "setup", "--no-attach", "declare")


def _assert_exact(s: dict, steps: int) -> None:
    assert s["steps"] == steps and s["in_flight"] == 0 and s["dlq"] == 0, s
    assert s["admitted"] == s["trained"] + s["dropped_stale"] + s["filtered"] + s["rejected"], s


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_compose_up_scaled_run_finishes_with_exact_accounting():
    """Build, `up --scale rollout=2 --scale reward=2 --no-attach setup --no-attach declare
    --exit-code-from trainer` a 10-step run (the one-shot services not attached: else compose
    2.26 aborts the stack when the first of them exits, and hangs),
    then: the same run again is refused by `setup` naming the fix; after `down -v` a new run id
    runs. TORCH_INDEX_URL (build arg) and AREAL_COMPOSE_OVERRIDE (extra -f file) pass through."""
    if reason := _docker_answers():
        pytest.skip(reason)
    project = f"areal-test-{uuid.uuid4().hex[:6]}"
    files = ["-f", str(COMPOSE)]
    if os.environ.get("AREAL_COMPOSE_OVERRIDE"):
        files += ["-f", os.environ["AREAL_COMPOSE_OVERRIDE"]]
    dc = ["docker", "compose", "-p", project, *files]
    runs = [f"{project}-a", f"{project}-b"]
    env = {**os.environ, "AREAL_TRAIN__TOTAL_STEPS": "10"}

    def up(run_id: str, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*dc, "up", *extra, *ONE_SHOT, "--exit-code-from", "trainer"],
            env={**env, "AREAL_RUN_ID": run_id},
            capture_output=True,
            text=True,
        )

    try:
        subprocess.run([*dc, "build"], env=env, check=True, capture_output=True)
        scale = ("--scale", "rollout=2", "--scale", "reward=2")
        r = up(runs[0], *scale)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        s = _summary(runs[0])
        _assert_exact(s, 10)
        assert s["trained"] == 10 * 16  # batch_size tasks per step (examples/arithmetic.yaml)
        logs = subprocess.run(
            [*dc, "logs", "--no-color", "rollout"],
            env={**env, "AREAL_RUN_ID": runs[0]},
            capture_output=True,
            text=True,
        ).stdout
        assert len(_samples_by_replica(logs)) == 2, logs[-3000:]  # both replicas generated
        rewards = subprocess.run(
            [*dc, "logs", "--no-color", "reward"],
            env={**env, "AREAL_RUN_ID": runs[0]},
            capture_output=True,
            text=True,
        ).stdout
        scored = _scored_by_replica(rewards)  # each reward replica logs its share at exit
        assert len(scored) == 2 and all(c["groups"] > 0 for c in scored.values()), scored
        # every trained task's group was scored once by one of them (a redelivery may add)
        assert sum(c["groups"] for c in scored.values()) >= s["trained"], scored
        again = up(runs[0])  # the same, finished run: setup refuses it, naming the fix
        assert again.returncode != 0
        assert 'service "setup" didn\'t complete successfully: exit 2' in again.stderr
        why = subprocess.run(  # not attached: its line is in its log
            [*dc, "logs", "--no-color", "setup"],
            env={**env, "AREAL_RUN_ID": runs[0]},
            capture_output=True,
            text=True,
        )
        assert "already finished" in why.stdout + why.stderr
        subprocess.run([*dc, "down", "-v"], env=env, check=True, capture_output=True)
        r = up(runs[1])
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        assert _summary(runs[1])["steps"] == 10
    finally:
        subprocess.run([*dc, "down", "-v"], env=env, capture_output=True)
        for run_id in runs:
            shutil.rmtree(ROOT / "runs" / run_id, ignore_errors=True)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_compose_cluster_survives_a_node_kill_and_refuses_a_second_trainer():
    """The cluster override (three NATS nodes, replicas 3): a 40-step run with 2 rollout
    replicas; after step 3 a second trainer is started beside the first (`compose run`): it
    exits 2 naming the holder; then one node is SIGKILLed, and the run finishes exact."""
    if reason := _docker_answers():
        pytest.skip(reason)
    project = f"areal-test-{uuid.uuid4().hex[:6]}"
    run_id = f"{project}-c"
    files = ["-f", str(COMPOSE), "-f", str(ROOT / "docker" / "compose.cluster.yml")]
    if os.environ.get("AREAL_COMPOSE_OVERRIDE"):
        files += ["-f", os.environ["AREAL_COMPOSE_OVERRIDE"]]
    dc = ["docker", "compose", "-p", project, *files]
    env = {**os.environ, "AREAL_TRAIN__TOTAL_STEPS": "40", "AREAL_RUN_ID": run_id}
    metrics = ROOT / "runs" / run_id / "metrics.jsonl"
    try:
        subprocess.run([*dc, "build"], env=env, check=True, capture_output=True)
        up = subprocess.Popen(
            [
                *dc,
                "up",
                "--scale",
                "rollout=2",
                # not attached: the exit of a node must not end the stack (compose's
                # --abort-on-container-exit, implied by --exit-code-from, watches attached ones)
                *ONE_SHOT,
                "--no-attach",
                "nats",
                *("--no-attach", "nats-2", "--no-attach", "nats-3"),
                "--exit-code-from",
                "trainer",
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        while up.poll() is None and not (
            metrics.exists() and len(metrics.read_text().splitlines()) >= 3
        ):
            time.sleep(0.5)
        if up.poll() is not None:
            out, err = up.communicate()
            pytest.fail(f"the stack ended before step 3: {out[-4000:]}{err[-4000:]}")
        dup = subprocess.run(  # refused before it loads its model: one renewal period
            [*dc, "run", "--rm", "--no-deps", "trainer"], env=env, capture_output=True, text=True
        )
        subprocess.run([*dc, "kill", "-s", "SIGKILL", "nats-2"], env=env, check=True)
        out, err = up.communicate(timeout=3000)  # hang guard
        assert up.returncode == 0, out[-4000:] + err[-4000:]
        assert dup.returncode == 2, dup.stdout[-3000:] + dup.stderr[-3000:]
        assert "already has a trainer: worker 'trainer-0'" in dup.stdout + dup.stderr
        s = _summary(run_id)
        _assert_exact(s, 40)
        logs = subprocess.run(
            [*dc, "logs", "--no-color", "rollout"], env=env, capture_output=True, text=True
        ).stdout
        assert len(_samples_by_replica(logs)) == 2, logs[-3000:]
        # the teardown docs/deploy/compose.md gives: `down -v` with the same files, nothing left
        subprocess.run([*dc, "down", "-v"], env=env, check=True, capture_output=True)
        assert _project_leftovers(project) == ([], [])
    finally:
        subprocess.run([*dc, "down", "-v"], env=env, capture_output=True)
        shutil.rmtree(ROOT / "runs" / run_id, ignore_errors=True)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compose_cluster_down_v_takes_the_files_of_up():
    """The cause of nodes left behind (issue 46): `down -v` reading only docker-compose.yml
    leaves nats-2, nats-3 and their volumes; with the cluster file too, nothing is left. The
    nodes are created, not started (no run needed for what `down` removes)."""
    if reason := _docker_answers():
        pytest.skip(reason)
    project = f"areal-test-{uuid.uuid4().hex[:6]}"
    base = ["docker", "compose", "-p", project, "-f", str(COMPOSE)]
    cluster = [*base, "-f", str(ROOT / "docker" / "compose.cluster.yml")]
    env = {**os.environ, "AREAL_RUN_ID": project}
    try:
        subprocess.run([*cluster, "build"], env=env, check=True, capture_output=True)
        r = subprocess.run(
            [*cluster, "create", "nats", "nats-2", "nats-3"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        subprocess.run([*base, "down", "-v"], env=env, check=True, capture_output=True)
        containers, volumes = _project_leftovers(project)
        assert sorted(containers) == [f"{project}-nats-2-1", f"{project}-nats-3-1"]
        assert sorted(volumes) == [f"{project}_nats-2", f"{project}_nats-3"]
        subprocess.run([*cluster, "down", "-v"], env=env, check=True, capture_output=True)
        assert _project_leftovers(project) == ([], [])
    finally:
        subprocess.run([*cluster, "down", "-v"], env=env, capture_output=True)


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compose_ports_publish_beside_a_nats_on_4222():
    """`-f docker/compose.ports.yml` starts beside a server that holds 127.0.0.1:4222 (the
    host's NATS, or a stand-in socket when none runs): NATS answers on 127.0.0.1:18222 and
    14222, the 4222 holder is untouched, and `down -v` with the same files leaves nothing."""
    if reason := _docker_answers():
        pytest.skip(reason)
    project = f"areal-test-{uuid.uuid4().hex[:6]}"
    dc = ["docker", "compose", "-p", project, "-f", str(COMPOSE)]
    dc += ["-f", str(ROOT / "docker" / "compose.ports.yml")]
    env = {**os.environ, "AREAL_RUN_ID": project}
    for k in ("AREAL_NATS_HOST_PORT", "AREAL_NATS_MONITOR_HOST_PORT"):
        env.pop(k, None)
    holder = None
    try:
        socket.create_connection(("127.0.0.1", 4222), timeout=2).close()
    except OSError:  # nothing on 4222: hold it ourselves
        holder = socket.socket()
        holder.bind(("127.0.0.1", 4222))
        holder.listen()
    try:
        subprocess.run([*dc, "build"], env=env, check=True, capture_output=True)
        r = subprocess.run(
            [*dc, "up", "-d", "--wait", "nats"], env=env, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        health = "http://127.0.0.1:18222/healthz?js-enabled-only=true"
        with urllib.request.urlopen(health, timeout=5) as resp:
            assert json.loads(resp.read())["status"] == "ok"
        with socket.create_connection(("127.0.0.1", 14222), timeout=5) as s:
            assert s.recv(5) == b"INFO "  # a NATS server's greeting
        socket.create_connection(("127.0.0.1", 4222), timeout=2).close()  # still held
        subprocess.run([*dc, "down", "-v"], env=env, check=True, capture_output=True)
        assert _project_leftovers(project) == ([], [])
    finally:
        subprocess.run([*dc, "down", "-v"], env=env, capture_output=True)
        shutil.rmtree(ROOT / "runs" / project, ignore_errors=True)
        if holder is not None:
            holder.close()
