"""The attacks on a run that one role's account could make (issue: "any account can stop a
run"), each as the server sees it: a JetStream API request or a publish with that role's
credentials. Used by the integration tests (each refused, nothing changed) and by the e2e test
that makes them against a live run (which must finish exact).

Each attack returns once the server refused it (`Refusal`: the subject it refused) or raises
`AttackLanded` naming what the server accepted. Waits are events with a hang guard.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from areal.bus.auth import Credentials, Denials, same_subject
from areal.bus.codec import encode
from areal.bus.connection import connect
from schemas import Event
from schemas import subjects as S
from schemas.subjects import RunNames

GUARD_S = 60.0
API = "$JS.API"


class AttackLanded(AssertionError):
    """The server accepted what the attacker's account should not be able to do."""


@dataclass(frozen=True)
class Refusal:
    attack: str
    subject: str


Creds = Callable[[str], Credentials]


async def _request_refused(url: str, creds: Credentials, attack: str, subject: str, body: dict):
    """Send `body` to `subject` as a request; the server must refuse the publish (a permission
    violation, reported to `Denials`), never answer it."""
    denials = Denials()
    nc = await connect(url, f"attacker-{attack}", credentials=creds, denials=denials)
    refused = asyncio.Event()
    denials.listen(lambda _op, subj: refused.set() if same_subject(subj, subject) else None)
    answers: asyncio.Queue = asyncio.Queue()
    inbox = nc.new_inbox()

    async def on_answer(msg) -> None:
        answers.put_nowait(msg)

    sub = await nc.subscribe(inbox, cb=on_answer)
    try:
        await nc.publish(subject, json.dumps(body).encode(), reply=inbox)
        got_answer = asyncio.ensure_future(answers.get())
        got_refusal = asyncio.ensure_future(refused.wait())
        done, _ = await asyncio.wait(
            {got_answer, got_refusal}, timeout=GUARD_S, return_when=asyncio.FIRST_COMPLETED
        )
        for fut in (got_answer, got_refusal):
            fut.cancel()
        if got_refusal in done:
            return Refusal(attack, subject)
        if got_answer in done:
            answer = got_answer.result()
            raise AttackLanded(f"{attack}: the server answered {subject}: {answer.data[:300]!r}")
        raise AttackLanded(f"{attack}: neither refused nor answered in {GUARD_S:.0f} s")
    finally:
        await sub.unsubscribe()
        await nc.close()


def _push_consumer(stream: str, deliver_subject: str, filter_subject: str | None = None) -> dict:
    config: dict = {"deliver_subject": deliver_subject, "ack_policy": "none"}
    if filter_subject:
        config["filter_subject"] = filter_subject
    return {"stream_name": stream, "config": config}


async def monitor_delivers_metrics_to_run_finished(url: str, run: str, creds: Creds) -> Refusal:
    """As the monitor: a push consumer on the metrics stream delivering to
    `events.run_finished` (stopped every worker within 0.2 s before)."""
    n = RunNames(run)
    body = _push_consumer(n.stream(S.METRICS), n.events_subject("run_finished"))
    return await _request_refused(
        url, creds("monitor"), "monitor-push", f"{API}.CONSUMER.CREATE.{n.stream(S.METRICS)}", body
    )


async def rollout_delivers_its_kv_key(url: str, run: str, creds: Creds, target: str) -> Refusal:
    """As the rollout: write a run_finished event into the KV key `eval.fake` (which it may
    write), then a push consumer of that key delivering it to `target` (e.g.
    `events.run_finished`, or the trainer's `rewards` queue)."""
    n = RunNames(run)
    nc = await connect(url, "attacker-rollout-kv", credentials=creds("rollout"))
    try:
        forged = encode(Event(type="run_finished", role="trainer", worker_id="trainer-0"))
        await nc.jetstream().publish(f"$KV.{n.state_bucket}.eval.fake", forged)
    finally:
        await nc.close()
    stream = f"KV_{n.state_bucket}"
    body = _push_consumer(stream, target, f"$KV.{n.state_bucket}.eval.fake")
    return await _request_refused(
        url, creds("rollout"), "rollout-kv-push", f"{API}.CONSUMER.CREATE.{stream}", body
    )


async def shrink_rewards_stream(url: str, run: str, creds: Creds, role: str) -> Refusal:
    """As `role` (the controller or the trainer could before): `STREAM.UPDATE` of the rewards
    stream with `max_msgs=1`, deleting the scored groups queued for the trainer."""
    n = RunNames(run)
    name = n.stream(S.REWARDS)
    body = {"name": name, "subjects": [n.subject(S.REWARDS)], "max_msgs": 1}
    body |= {"retention": "workqueue", "storage": "file"}
    return await _request_refused(
        url, creds(role), f"{role}-stream-update", f"{API}.STREAM.UPDATE.{name}", body
    )


async def rewrite_stage_consumer(url: str, run: str, creds: Creds, role: str) -> Refusal:
    """As `role`: re-create the trainer's durable consumer with a filter that matches nothing
    (the trainer would starve)."""
    n = RunNames(run)
    stream, durable = n.stream(S.REWARDS), S.CONSUMER_OF[S.REWARDS]
    body = {
        "stream_name": stream,
        "config": {"durable_name": durable, "ack_policy": "explicit", "filter_subject": "x.y"},
    }
    subject = f"{API}.CONSUMER.CREATE.{stream}.{durable}"
    return await _request_refused(url, creds(role), f"{role}-consumer-rewrite", subject, body)


def every_attack(url: str, run: str, creds: Creds) -> list[Callable[[], Awaitable[Refusal]]]:
    """Every attack above, once per role that could make it before."""
    n = RunNames(run)
    attacks: list[Callable[[], Awaitable[Refusal]]] = [
        lambda: monitor_delivers_metrics_to_run_finished(url, run, creds),
        lambda: rollout_delivers_its_kv_key(url, run, creds, n.events_subject("run_finished")),
        lambda: rollout_delivers_its_kv_key(url, run, creds, n.subject(S.REWARDS)),
    ]
    for role in ("controller", "trainer", "rollout", "reward"):
        attacks.append(lambda role=role: shrink_rewards_stream(url, run, creds, role))
        attacks.append(lambda role=role: rewrite_stage_consumer(url, run, creds, role))
    return attacks


async def unsigned_run_finished(url: str, run: str, creds: Credentials) -> None:
    """Publish a `run_finished` event that is not signed with the run's key (as one holding
    the trainer's NATS password but not its signing key, which stays on the launcher's host).
    The server takes it (the account may publish there); the workers must not stop."""
    n = RunNames(run)
    nc = await connect(url, "attacker-unsigned", credentials=creds)
    try:
        ev = Event(type="run_finished", role="trainer", worker_id="trainer-0", detail={"steps": 1})
        await nc.jetstream().publish(n.events_subject("run_finished"), encode(ev))
    finally:
        await nc.close()
