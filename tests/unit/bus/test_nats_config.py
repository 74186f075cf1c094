"""The role table of `areal.bus.nats_config` (what each account may publish and subscribe to)
and its credentials files, without a server (`tests/integration/test_nats_permissions.py`
checks the same against a real one)."""

from __future__ import annotations

import json
import stat

import pytest

from areal.bus.auth import (
    Credentials,
    CredentialsError,
    credentials_for,
    load_credentials,
    permission_violation,
)
from areal.bus.nats_config import (
    DECLARERS,
    ROLES,
    authorization_block,
    ensure_accounts,
    parse_listen,
    permissions,
    subject_matches,
    user_name,
)
from areal.config import NatsSettings
from schemas import subjects as S
from schemas.subjects import RunNames

RUN = "exp-1"
N = RunNames(RUN)
KV = N.state_bucket


def perms(role: str, run: str = RUN):
    return permissions(role, run, user_name(run, role))


def publishers(subject: str) -> set[str]:
    return {role for role in ROLES if perms(role).may_publish(subject)}


@pytest.mark.parametrize(
    ("subject", "roles"),
    [
        (N.subject("prompts"), {"controller"}),
        (N.subject("trajectories"), {"rollout"}),
        (N.subject("rewards"), {"reward"}),
        (N.subject("weights"), {"trainer"}),
        (f"$KV.{KV}.controller", {"controller"}),
        (f"$KV.{KV}.trainer", {"trainer"}),
        (f"$KV.{KV}.eval.r3", {"rollout"}),  # evaluation round claims
        (f"$O.{N.weights_bucket}.C.abc", {"trainer"}),
        (f"$O.{N.files_bucket}.M.abc", {"launcher"}),
        (N.events_subject("run_finished"), {"trainer"}),  # it stops every worker
        (N.events_subject("step_skipped"), {"controller", "rollout", "reward", "trainer"}),
        # the launcher's watchdog names frozen workers (`areal.launch.watchdog`)
        (
            N.events_subject("worker_frozen"),
            {"controller", "rollout", "reward", "trainer", "launcher"},
        ),
        (N.subject("metrics", "rollout", "heartbeat"), {"rollout"}),
        (N.subject("metrics", "trainer", "step"), {"trainer"}),
        (N.dlq_subject("prompts"), {"rollout"}),
        (N.dlq_subject("trajectories"), {"reward"}),
        (N.dlq_subject("rewards"), {"trainer"}),
        (f"$JS.API.CONSUMER.MSG.NEXT.{N.stream('prompts')}.rollout", {"rollout"}),
        (f"$JS.ACK.{N.stream('rewards')}.trainer.1.2.3.4.0", {"trainer"}),
        (f"$JS.API.STREAM.CREATE.{N.stream('prompts')}", set(DECLARERS)),
        (f"$JS.API.STREAM.UPDATE.{N.stream('metrics')}", set(DECLARERS)),
        (f"$JS.API.STREAM.CREATE.OBJ_{N.files_bucket}", {"launcher"}),
        (f"$JS.API.STREAM.PURGE.OBJ_{N.weights_bucket}", {"trainer"}),
        (f"$JS.API.STREAM.PURGE.{N.stream('prompts')}", set()),
        (f"$JS.API.STREAM.DELETE.{N.stream('prompts')}", set()),
        (f"$JS.API.STREAM.MSG.DELETE.{N.stream('rewards')}", set()),
        (f"$JS.API.CONSUMER.DELETE.{N.stream('rewards')}.trainer", set()),
        (f"$JS.API.CONSUMER.DURABLE.CREATE.{N.stream('metrics')}.mine", set()),
        # another run's subjects: nobody of this run
        (RunNames("exp-2").subject("prompts"), set()),
        (f"$KV.{RunNames('exp-2').state_bucket}.trainer", set()),
    ],
)
def test_who_may_publish_what(subject, roles):
    assert publishers(subject) == roles


def test_the_monitor_publishes_nothing_but_read_requests():
    p = perms("monitor")
    assert all(s.startswith(("$JS.API.", "$JS.FC.")) for s in p.publish)
    writes = ("CREATE", "UPDATE", "DELETE", "PURGE", "MSG.NEXT", "DURABLE")
    for s in p.publish:
        assert not any(w in s for w in writes), s
    assert p.may_subscribe(N.subject("trajectories")) and p.may_subscribe(N.subject(">"))


@pytest.mark.parametrize("role", [r for r in ROLES if r not in DECLARERS])
def test_no_worker_or_monitor_creates_a_consumer_or_changes_a_stream(role):
    """A consumer's creator names its deliver subject, and the server delivers there on its
    behalf unchecked; a stream update can shrink a stage's queue. Only the launcher may."""
    p = perms(role)
    streams = [N.stream(s) for s in S.ALL_STREAMS] + [f"KV_{KV}", f"OBJ_{N.weights_bucket}"]
    for stream in streams:
        for api in ("CONSUMER.CREATE", "CONSUMER.DURABLE.CREATE", "STREAM.UPDATE"):
            for tail in ("", ".evil", ".evil.x.>", ".trainer", ".rollout", ".reward"):
                subject = f"$JS.API.{api}.{stream}{tail}"
                assert not p.may_publish(subject), (role, subject)
    assert not any(s.startswith("$JS.FC.") for s in p.publish)


def test_every_account_reads_replies_only_under_its_own_inbox():
    for role in ROLES:
        p = perms(role)
        user = user_name(RUN, role)
        assert p.may_subscribe(f"_INBOX.{user}.abc.*")
        assert not p.may_subscribe("_INBOX.>")
        assert not p.may_subscribe(
            f"_INBOX.{user_name(RUN, 'trainer' if role != 'trainer' else 'rollout')}.x"
        )
        if role != "monitor":  # only the monitor taps the work queues
            assert not p.may_subscribe(N.subject("prompts")), role


def test_every_run_wildcard_keeps_the_role_separation_on_subjects_and_keys():
    rollout = perms("rollout", "*")
    assert rollout.may_publish("areal.any-run.trajectories")
    assert not rollout.may_publish("areal.any-run.weights")
    assert not rollout.may_publish("$KV.areal_any-run_state.trainer")
    assert perms("trainer", "*").may_publish("$KV.areal_any-run_state.trainer")
    assert user_name("*", "rollout") == "areal-any-rollout"


def test_subject_matching_follows_nats_wildcards():
    assert subject_matches("a.*.c", "a.b.c") and not subject_matches("a.*.c", "a.b.d")
    assert subject_matches("a.>", "a.b.c") and not subject_matches("a.>", "a")
    assert subject_matches("a.*", "a.*") and not subject_matches("a.b", "a.*")
    assert not subject_matches("a.b.>", "a.>")  # a wider subscription is not covered


def test_accounts_keep_their_passwords_unless_rotated(tmp_path):
    first = {a.user: a.password for a in ensure_accounts(tmp_path, [RUN])}
    assert set(first) == {user_name(RUN, r) for r in ROLES}
    again = {a.user: a.password for a in ensure_accounts(tmp_path, [RUN])}
    assert again == first  # a resumed run, a regenerated config: holders keep working
    rotated = {a.user: a.password for a in ensure_accounts(tmp_path, [RUN], rotate=True)}
    assert all(rotated[u] != first[u] for u in first)
    f = tmp_path / "rollout.json"
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700
    data = json.loads(f.read_text())
    assert data["inbox_prefix"] == f"_INBOX.{data['user']}" and data["role"] == "rollout"


def test_several_runs_get_a_dir_each(tmp_path):
    ensure_accounts(tmp_path, ["run-a", "run-b"], ("rollout",))
    assert json.loads((tmp_path / "run-b" / "rollout.json").read_text())["run_id"] == "run-b"
    with pytest.raises(ValueError, match="run id"):
        ensure_accounts(tmp_path / "bad", ["Not A Run"])


def test_the_authorization_block_holds_each_user_and_no_other_secret(tmp_path):
    accounts = ensure_accounts(tmp_path, [RUN], ("monitor", "trainer"))
    block = authorization_block(accounts)
    assert block.count('"user"') == 2 and all(a.password in block for a in accounts)
    assert accounts[0].password not in repr(accounts[0])


def test_listen_addresses():
    assert parse_listen("0.0.0.0:4222") == ("0.0.0.0", 4222)
    assert parse_listen("[::]:4222") == ("::", 4222)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_listen("4222")


# ---------------------------------------------------------------- areal.bus.auth
def test_credentials_come_from_the_file_or_the_roles_file_in_the_dir(tmp_path):
    ensure_accounts(tmp_path, [RUN], ("rollout", "monitor"))
    by_dir = credentials_for(NatsSettings(credentials_dir=str(tmp_path)), "rollout")
    assert by_dir.user == user_name(RUN, "rollout") and by_dir.inbox_prefix
    by_file = credentials_for(
        NatsSettings(
            credentials_dir=str(tmp_path), credentials_file=str(tmp_path / "monitor.json")
        ),
        "rollout",
    )
    assert by_file.user == user_name(RUN, "monitor")  # the file wins
    assert credentials_for(NatsSettings(), "rollout") == Credentials()
    with pytest.raises(CredentialsError, match="no trainer.json for role 'trainer'"):
        credentials_for(NatsSettings(credentials_dir=str(tmp_path)), "trainer")
    assert by_dir.password not in repr(by_dir) and by_dir.password not in by_dir.describe()


def test_bad_credentials_files_name_the_file(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    with pytest.raises(CredentialsError, match=r"x\.json is not a NATS credentials file"):
        load_credentials(bad)
    with pytest.raises(CredentialsError, match="cannot be read"):
        load_credentials(tmp_path / "missing.json")
    jwt = tmp_path / "user.creds"
    jwt.write_text("-----BEGIN NATS USER JWT-----\nabc\n------END NATS USER JWT------\n")
    assert load_credentials(jwt).connect_options() == {"user_credentials": str(jwt)}


def test_the_servers_permission_errors_are_parsed():
    err = 'nats: permissions violation for publish to "areal.r.weights"'
    assert permission_violation(err) == ("publish", "areal.r.weights")
    assert permission_violation('Permissions Violation for Subscription to "_INBOX.>"') == (
        "subscription",
        "_INBOX.>",
    )
    assert permission_violation("nats: timeout") is None


def test_the_launcher_hears_every_roles_heartbeats_for_its_watchdog():
    launcher = perms("launcher")
    for role in ("controller", "rollout", "reward", "trainer"):
        assert launcher.may_subscribe(N.subject("metrics", role, "heartbeat")), role
    assert not launcher.may_subscribe(N.subject("metrics", "rollout", "eval"))
    assert launcher.may_publish(N.events_subject("worker_recovered"))
    assert not launcher.may_publish(N.events_subject("run_finished"))
