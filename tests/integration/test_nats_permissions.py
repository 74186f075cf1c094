"""Least privilege on a real nats-server: the config `areal.bus.nats_config` generates gives
each role exactly what its code does on the bus, and the server refuses the rest.

Every role is the real `Bus` (or `TapClient`, or `run_files`) on its own account doing what its
service does; each refusal is the server's, reported as `PermissionDenied` /
`AuthenticationFailed` (never a silent retry). Waits are events with generous hang guards."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest

from areal.bus.auth import Credentials, Denials, load_credentials, same_subject
from areal.bus.client import Bus
from areal.bus.connection import Patience, connect
from areal.bus.embedded import EmbeddedNats, free_port
from areal.bus.errors import AuthenticationFailed, PermissionDenied
from areal.bus.nats_config import authorization_block, ensure_accounts, write_server_config
from areal.bus.run_files import fetch_run_files, publish_run_files
from areal.bus.tap import TapClient, TapMessage, discover_run
from areal.config import NatsSettings
from schemas import ScoredSample, Task, WeightAnnouncement
from schemas import subjects as S
from schemas.state import (
    CONTROLLER_KEY,
    TRAINER_KEY,
    ControllerState,
    EvalClaim,
    TrainerState,
    eval_claim_key,
)
from tests.factories import make_sample, make_task

pytestmark = pytest.mark.integration
GUARD_S = 60.0  # hang guard of every wait (never a timing assertion)


@pytest.fixture
def secure(tmp_path: Path, run_id: str):
    """A server with the run's per-role accounts (what `areal run` starts), and a function
    from role to that role's credentials."""
    keys = tmp_path / "keys"
    accounts = ensure_accounts(keys, [run_id])
    server = EmbeddedNats(
        store_dir=tmp_path / "nats", authorization=authorization_block(accounts)
    ).start()

    def creds(role: str) -> Credentials:
        return load_credentials(keys / f"{role}.json")

    try:
        yield server, creds
    finally:
        server.stop()


async def bus_of(url, run_id, role, creds, **kw) -> Bus:
    return await Bus.connect(
        url, run_id, role, f"{role}-0", NatsSettings(), credentials=creds(role), **kw
    )


async def until(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), GUARD_S)


async def consume_one(bus: Bus, stream: str, cls, *, ack: bool = True):
    """The first message of `stream` through the role's durable consumer (acked)."""
    got: list = []
    stop = asyncio.Event()

    async def handler(msg, lease) -> None:
        got.append(msg)
        if ack:
            await lease.ack()
        stop.set()

    await asyncio.wait_for(
        bus.consume(stream, cls, handler, max_inflight=4, stop=stop, expires_s=1.0), GUARD_S
    )
    return got[0]


async def test_each_role_does_its_job_through_its_own_account(secure, run_id, tmp_path):
    server, creds = secure
    url = server.url
    # no worker may declare: they wait for the launcher to
    rollout = await bus_of(url, run_id, "rollout", creds, declare=False)
    waiting = asyncio.ensure_future(rollout.wait_declared(asyncio.Event(), report_s=1.0))
    launcher = await bus_of(url, run_id, "launcher", creds)  # declares the run
    assert await asyncio.wait_for(waiting, GUARD_S)
    await launcher.declare()  # again (a resumed run): finds it declared, changes nothing
    await launcher.close()
    controller = await bus_of(url, run_id, "controller", creds, declare=False)
    trainer = await bus_of(url, run_id, "trainer", creds, declare=False)
    reward = await bus_of(url, run_id, "reward", creds, declare=False)
    assert await reward.wait_declared(asyncio.Event())

    # controller: run state, prompts, its metrics; reads the trainer's state
    watch = await controller.kv_watch(TRAINER_KEY)
    assert await controller.kv_get(TRAINER_KEY, TrainerState) is None
    await controller.kv_put(CONTROLLER_KEY, ControllerState(admitted=1))
    await controller.publish(S.PROMPTS, make_task())
    await controller.metric("admission", {"admitted": 1})

    # rollout: pulls the prompt, publishes a sample, claims an evaluation round
    task = await consume_one(rollout, S.PROMPTS, Task)
    assert task.task_id == "t-good"
    await rollout.publish(S.TRAJECTORIES, make_sample())
    claim = EvalClaim(round=0, worker_id="rollout-0", claimed_at=0.0)
    assert await rollout.kv_claim(eval_claim_key(0), claim)
    await rollout.metric("heartbeat", {"up": 1})
    announced = asyncio.Event()
    anns: list[WeightAnnouncement] = []

    async def on_weights(ann: WeightAnnouncement) -> None:
        anns.append(ann)
        announced.set()

    await rollout.subscribe_weights(on_weights)
    assert await rollout.latest_weights() is None

    # reward: pulls the sample, publishes its score
    sample = await consume_one(reward, S.TRAJECTORIES, type(make_sample()))
    await reward.publish(S.REWARDS, ScoredSample(sample=sample, reward=1.0))
    await reward.metric("heartbeat", {"up": 1})

    # trainer: pulls the score, reads the controller's state, stores + announces weights,
    # writes its state, reads the DLQ depth, replays the rollouts' eval metrics, ends the run
    evals = asyncio.Event()
    await rollout.metric("eval", {"round": 0})

    async def on_eval(_rec) -> None:
        evals.set()

    await trainer.subscribe_metrics("rollout", "eval", on_eval, replay=True)
    await until(evals)
    scored = await consume_one(trainer, S.REWARDS, ScoredSample)
    assert scored.reward == 1.0
    assert (await trainer.kv_get(CONTROLLER_KEY, ControllerState)).admitted == 1
    data = b"w" * 3000
    ann = await trainer.put_weights(1, data, "float32", step=1)
    await trainer.put_weights(2, b"v" * 10, "float32", step=2)  # and its old ones go
    await trainer.kv_put(TRAINER_KEY, TrainerState(version=2, step=2))
    assert await trainer.stream_depth(S.DLQ) == 0
    assert await watch.wait(GUARD_S)  # the controller saw the trainer's write
    await watch.stop()

    # rollout: the announcement arrives, the object store serves the weights
    await until(announced)
    assert await rollout.get_weights(ann) == data
    assert (await rollout.latest_weights()).version == 2
    for bus in (controller, reward):  # they read the newest version too (admission, staleness)
        assert (await bus.latest_weights()).version == 2

    # monitor: reads everything, writes nothing
    seen = asyncio.Event()
    lines: list[TapMessage] = []

    async def on_msg(tm: TapMessage) -> None:
        lines.append(tm)
        seen.set()

    tap = await TapClient.connect(url, run_id, credentials=creds("monitor"))
    assert await discover_run(url, credentials=creds("monitor")) == run_id
    await tap.check_run()
    await tap.follow("metrics.trainer.step", on_msg)
    await tap.follow(S.EVENTS, on_msg, history=-1)
    await tap.follow(S.TRAJECTORIES, on_msg, history=5)  # a peek at the queue, no consumer
    await tap.follow(S.WEIGHTS, on_msg, history=1)
    stats = await tap.stream_stats()
    assert stats[S.PROMPTS].ack_pending == 0 and stats[S.WEIGHTS].messages == 2
    assert (await tap.kv_state())["trainer"]["version"] == 2
    finished = asyncio.Event()
    await tap.on_run_finished(finished.set)
    await tap.kv_state()  # a round trip on the tap's connection: its subscription is in place
    await trainer.event("run_finished", steps=2)
    await until(finished)
    assert any(m.subject.endswith(".weights") for m in lines)
    await tap.close()
    for bus in (controller, rollout, reward, trainer):
        await bus.close()

    # launcher shares the run's files; a worker joining from elsewhere fetches them
    await publish_run_files(url, run_id, {"config.json": b"{}"}, credentials=creds("launcher"))
    manifest, where = await fetch_run_files(
        url, run_id, tmp_path / "joined", credentials=creds("rollout")
    )
    assert (where / "config.json").read_bytes() == b"{}"


async def declared(url: str, run_id: str, creds) -> None:
    """The run declared by its launcher (what `areal run` does before any worker starts)."""
    await (await bus_of(url, run_id, "launcher", creds)).close()


@pytest.mark.slow  # ~29 s on 2 cores: every role against every permission it lacks, each waiting for the server's refusal
async def test_roles_are_refused_what_is_not_theirs(secure, run_id):
    server, creds = secure
    await declared(server.url, run_id, creds)
    trainer = await bus_of(server.url, run_id, "trainer", creds, declare=False)
    rollout = await bus_of(server.url, run_id, "rollout", creds, declare=False)
    reward = await bus_of(server.url, run_id, "reward", creds, declare=False)
    ann = WeightAnnouncement(version=9, uri="nats-obj://x/v9", sha256="0" * 64, bytes=1)
    try:
        with pytest.raises(PermissionDenied, match=r"areal-.*-rollout.*\.weights"):
            await rollout.publish(S.WEIGHTS, ann)  # only the trainer announces weights
        with pytest.raises(PermissionDenied, match=r"\$KV\..*\.trainer"):
            await rollout.kv_put(TRAINER_KEY, TrainerState(version=9))
        with pytest.raises(PermissionDenied, match=r"\$KV\..*\.controller"):
            await rollout.kv_put(CONTROLLER_KEY, ControllerState(admitted=0))
        with pytest.raises(PermissionDenied, match=r"(?i)obj_areal_.*_weights|\$o\."):
            await rollout.put_weights(9, b"forged", "float32", step=9)
        with pytest.raises(PermissionDenied, match="run_finished"):
            await rollout.event("run_finished", steps=0)  # would stop every worker
        with pytest.raises(PermissionDenied, match=r"\.prompts"):
            await reward.publish(S.PROMPTS, make_task())  # only the controller admits
        with pytest.raises(PermissionDenied, match=r"\.trajectories"):
            await reward.publish(S.TRAJECTORIES, make_sample())
        with pytest.raises(PermissionDenied, match=r"\.metrics\.trainer"):
            await reward.publish(S.METRICS, make_task(), "trainer", "step")  # not its metrics
        for bus in (rollout, trainer, reward):  # no worker may create or change a stream
            with pytest.raises(PermissionDenied, match=r"(?i)\$JS\.API\."):
                await bus.declare()
        # the refusals changed nothing
        assert await trainer.kv_get(TRAINER_KEY, TrainerState) is None
        assert await trainer.latest_weights() is None
        assert await trainer.stream_depth(S.PROMPTS) == 0
    finally:
        for bus in (trainer, rollout, reward):
            await bus.close()


async def refused(nc, denials: Denials, subject: str, data: bytes = b"x") -> None:
    """Publish `subject` (as a request would: with a reply inbox) and wait for the server's
    refusal of it."""
    got = asyncio.Event()
    denials.listen(lambda _op, subj: got.set() if same_subject(subj, subject) else None)
    await nc.publish(subject, data, reply=nc.new_inbox())
    await until(got)


async def test_the_monitor_reads_but_cannot_publish_anything(secure, run_id):
    server, creds = secure
    await declared(server.url, run_id, creds)
    trainer = await bus_of(server.url, run_id, "trainer", creds, declare=False)
    reward = await bus_of(server.url, run_id, "reward", creds, declare=False)
    await reward.publish(S.REWARDS, ScoredSample(sample=make_sample(), reward=0.5))
    await reward.close()
    names = S.RunNames(run_id)
    denials = Denials()
    nc = await connect(server.url, "evil-monitor", credentials=creds("monitor"), denials=denials)
    try:
        for subject in (
            names.subject(S.PROMPTS),
            names.subject(S.WEIGHTS),
            names.subject(S.METRICS, "monitor", "x"),
            names.subject(S.EVENTS, "run_finished"),
            names.dlq_subject(S.REWARDS),
            f"$KV.{names.state_bucket}.trainer",
            f"$O.{names.weights_bucket}.C.x",
            f"$JS.API.STREAM.DELETE.{names.stream(S.PROMPTS)}",
            f"$JS.API.STREAM.PURGE.{names.stream(S.REWARDS)}",
            f"$JS.API.STREAM.MSG.DELETE.{names.stream(S.REWARDS)}",
            f"$JS.API.STREAM.CREATE.{names.stream(S.PROMPTS)}",
            f"$JS.API.CONSUMER.MSG.NEXT.{names.stream(S.REWARDS)}.trainer",  # would consume
            f"$JS.API.CONSUMER.DURABLE.CREATE.{names.stream(S.METRICS)}.mine",
            f"$JS.API.CONSUMER.CREATE.{names.stream(S.METRICS)}",  # no consumer at all
            f"$JS.API.CONSUMER.DELETE.{names.stream(S.REWARDS)}.trainer",
            f"$JS.ACK.{names.stream(S.REWARDS)}.trainer.1.1.1.1.0",
        ):
            await refused(nc, denials, subject)
        # reading another account's replies is refused too (every inbox has its owner)
        sub_refused = asyncio.Event()
        denials.listen(lambda op, _s: sub_refused.set() if op == "subscription" else None)
        await nc.subscribe("_INBOX.>")
        await until(sub_refused)
        # the work queue is untouched: the trainer still gets its message
        assert (await consume_one(trainer, S.REWARDS, ScoredSample)).reward == 0.5
    finally:
        await nc.close()
        await trainer.close()


async def test_an_unauthenticated_or_wrong_client_cannot_connect(secure, run_id):
    server, creds = secure
    with pytest.raises(AuthenticationFailed, match="no credentials were given"):
        await connect(server.url, "anonymous")
    wrong = Credentials(user=creds("rollout").user, password="not-it", source="a stale file")
    with pytest.raises(AuthenticationFailed, match=r"areal-.*-rollout.*from a stale file"):
        await connect(server.url, "stale", credentials=wrong)
    # an observer is told which credentials to pass
    with pytest.raises(AuthenticationFailed, match=r"--credentials .*monitor\.json"):
        await TapClient.connect(server.url, run_id)
    # a worker's bus: the same, before anything is declared
    with pytest.raises(AuthenticationFailed):
        await Bus.connect(server.url, run_id, "rollout", "rollout-0", NatsSettings())


@pytest.mark.slow  # ~5 s on 2 cores: waits for the server's refusals
async def test_accounts_of_one_run_are_refused_another_runs_subjects(tmp_path):
    keys = tmp_path / "keys"
    accounts = ensure_accounts(keys, ["run-a", "run-b"])
    with EmbeddedNats(
        store_dir=tmp_path / "nats", authorization=authorization_block(accounts)
    ) as server:
        a_launcher = load_credentials(keys / "run-a" / "launcher.json")
        a_ctl = load_credentials(keys / "run-a" / "controller.json")
        await (
            await Bus.connect(server.url, "run-a", "launcher", "l", credentials=a_launcher)
        ).close()
        bus = await Bus.connect(
            server.url, "run-a", "controller", "c-0", credentials=a_ctl, declare=False
        )
        try:
            await bus.publish(S.PROMPTS, make_task())
            with pytest.raises(PermissionDenied, match="run-b"):  # not even run-a's launcher
                await Bus.connect(server.url, "run-b", "launcher", "l-1", credentials=a_launcher)
        finally:
            await bus.close()


def _self_signed(tmp: Path) -> tuple[Path, Path] | None:
    if shutil.which("openssl") is None:
        return None
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.mark.slow  # ~6 s on 2 cores: generates TLS keys, starts a server
async def test_the_generated_config_file_starts_a_server_with_tls(tmp_path, run_id):
    """`areal nats-config`'s output as an operator would use it: nats-server -c FILE."""
    from areal.bus.embedded import find_nats_server
    from areal.bus.nats_config import ServerTLS

    pair = _self_signed(tmp_path)
    if pair is None:
        pytest.skip("no openssl to make a test certificate")
    port = free_port()
    conf, _ = write_server_config(
        tmp_path / "cfg", [run_id], listen=f"127.0.0.1:{port}", tls=ServerTLS(*map(str, pair))
    )
    assert oct(conf.stat().st_mode & 0o777) == "0o600"
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([find_nats_server(), "-c", str(conf)], stdout=out, stderr=out)
    try:
        for _ in range(int(GUARD_S / 0.05)):
            if b"Server is ready" in log.read_bytes() or proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
        assert proc.poll() is None, log.read_text()
        nats = NatsSettings(credentials_dir=str(tmp_path / "cfg"), tls_ca_file=str(pair[0]))
        url = f"tls://127.0.0.1:{port}"
        await (await Bus.connect(url, run_id, "launcher", "l", nats)).close()  # declares, over TLS
        bus = await Bus.connect(url, run_id, "controller", "c-0", nats, declare=False)
        await bus.publish(S.PROMPTS, make_task())
        assert await bus.stream_depth(S.PROMPTS) == 1
        await bus.close()
        monitor = load_credentials(conf.parent / "monitor.json")
        with pytest.raises(ConnectionError):  # without the CA the server is not trusted
            await connect(url, "untrusting", credentials=monitor, patience=Patience(5.0))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
