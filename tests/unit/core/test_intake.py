"""Trainer intake core: filing, de-duplication, freshness, batches, accounting, checkpoints."""

from __future__ import annotations

import pytest

from areal.bus.codec import pack
from areal.core.intake import Filed, Intake, IntakePolicy, episode_stats
from schemas import ScoredSample
from schemas.state import CheckpointState, TrainerState
from tests.factories import make_sample


def scored(
    seq: int, idx: int, versions: list[int], reward: float = 1.0, g: int = 2
) -> ScoredSample:
    """Sample `idx` of task `t{seq}` whose tokens were generated at `versions`."""
    sample = make_sample(
        len(versions),
        task_id=f"t{seq}",
        task_seq=seq,
        sample_idx=idx,
        group_size=g,
        versions=pack(versions, "int32"),
    )
    return ScoredSample(sample=sample, reward=reward)


def group(
    seq: int, versions: list[int], rewards: tuple[float, ...] = (1, 0), g: int | None = None
) -> list[ScoredSample]:
    """The scored group message of task `t{seq}`: one sample per reward."""
    n = g or len(rewards)
    return [scored(seq, idx, versions, r, g=n) for idx, r in enumerate(rewards)]


def file_group(
    intake: Intake[str], seq: int, versions: list[int], rewards: tuple[float, float] = (1, 0)
) -> None:
    assert intake.file(group(seq, versions, rewards), f"h{seq}") is Filed.COMPLETED


def test_file_outcomes() -> None:
    intake: Intake[str] = Intake(IntakePolicy(batch_size=1, group_size=2, max_staleness=0))
    assert intake.file(group(0, [0], (1, 0, 1)), "x") is Filed.INVALID
    assert "group_size 3" in intake.last_error
    assert intake.file(group(0, [0]), "a") is Filed.COMPLETED  # the whole group in one message
    assert intake.file(group(0, [0]), "a2") is Filed.DUPLICATE  # a copy in hand: held too
    other = group(0, [0])
    other[0].sample.prompt_ids = pack([9], "int32")
    assert intake.file(other, "x") is Filed.INVALID  # a copy that disagrees with the group
    assert "prompt differs" in intake.last_error
    pick = intake.take_batch()
    assert pick.batch is not None
    intake.commit_step(pick.batch, version=1, wall_s=1.0)
    # ended, checkpoint pending: a copy is held and released with that checkpoint
    assert intake.file(group(0, [0]), "b2") is Filed.DUPLICATE
    ckpt, handles = intake.checkpoint()
    assert sorted(handles) == ["a", "a2", "b2"]  # one handle per group message
    assert ckpt.done_tasks == ["t0"]
    assert intake.checkpoint() == (ckpt, [])  # each handle is released once
    intake.checkpoint_written(ckpt)
    assert intake.file(group(0, [0]), "c") is Filed.ACK_NOW  # covered by a written ckpt


def test_a_group_in_parts_is_merged() -> None:
    """A group too big for one message arrives in parts; copies of parts (a second attempt may
    split differently) overlap: each index counts once, every handle is held with the group."""
    intake: Intake[str] = Intake(IntakePolicy(batch_size=1, group_size=4, max_staleness=0))
    whole = group(0, [0], (1, 0, 1, 0))
    assert intake.file(whole[:1], "p0") is Filed.HELD
    assert intake.file(whole[:2], "p01") is Filed.HELD  # index 0 again, index 1 new
    assert intake.file(whole[1:2], "p1") is Filed.DUPLICATE
    assert intake.take_batch().batch is None  # incomplete: nothing to train yet
    assert intake.file(whole[2:], "p23") is Filed.COMPLETED
    pick = intake.take_batch()
    assert pick.batch is not None and intake.rewards(pick.batch) == [[1, 0, 1, 0]]
    intake.commit_step(pick.batch, version=1, wall_s=1.0)
    assert sorted(intake.checkpoint()[1]) == ["p0", "p01", "p1", "p23"]


def test_stale_exactly_at_the_bound_is_fresh() -> None:
    intake: Intake[str] = Intake(IntakePolicy(1, 2, max_staleness=1), TrainerState(version=3))
    file_group(intake, 0, [1, 3])  # oldest token v1: lag 3 - 1 = 2 > 1 -> dropped
    file_group(intake, 1, [2, 3])  # oldest token v2: lag 1 = η -> fresh
    pick = intake.take_batch()
    assert [(r.task_id, r.reason, r.min_version) for r in pick.retired] == [
        ("t0", "dropped_stale", 1)
    ]
    assert pick.batch is not None and [g.task_id for g in pick.batch] == ["t1"]
    assert intake.state.dropped_stale == 1 and intake.state.returned == 1


def test_oldest_first_and_wait_for_b() -> None:
    intake: Intake[str] = Intake(IntakePolicy(batch_size=2, group_size=2, max_staleness=0))
    file_group(intake, 5, [0])
    assert intake.take_batch().batch is None  # 1 < B = 2 complete groups
    file_group(intake, 2, [0])
    file_group(intake, 9, [0])
    pick = intake.take_batch()
    assert pick.batch is not None and [g.task_seq for g in pick.batch] == [2, 5]


def test_a_batch_waits_for_an_older_open_task_then_passes_it_once() -> None:
    """B newer groups are ready while task 0 is still generating: the batch waits for it (it
    would go stale if skipped) until `straggler_wait_s`, then trains without it; a task passed
    once is not waited for again, and one that ends is forgotten."""
    intake: Intake[str] = Intake(IntakePolicy(2, 2, max_staleness=1, straggler_wait_s=5.0))
    file_group(intake, 1, [0])
    file_group(intake, 2, [0])
    pick = intake.take_batch(now=100.0)
    assert pick.batch is None and pick.retry_in == 5.0  # t0 is open and older
    assert intake.take_batch(now=103.0).retry_in == 2.0  # the clock runs from B ready
    file_group(intake, 0, [0])  # the straggler arrives in time: the oldest B go
    pick = intake.take_batch(now=104.0)
    assert pick.batch is not None and [g.task_seq for g in pick.batch] == [0, 1]
    intake.commit_step(pick.batch, version=1, wall_s=1.0)
    # t2 complete; t3 (open, partial) and t4 (open, nothing yet) are older than t5
    assert intake.file(group(3, [1])[:1], "h3") is Filed.HELD
    file_group(intake, 5, [1])
    assert intake.take_batch(now=200.0).retry_in == 5.0
    pick = intake.take_batch(now=205.0)  # waited long enough: t3 and t4 are passed
    assert pick.batch is not None and [g.task_seq for g in pick.batch] == [2, 5]
    assert intake.passed_stragglers == 2
    intake.commit_step(pick.batch, version=2, wall_s=2.0)
    file_group(intake, 6, [2])
    file_group(intake, 7, [2])
    pick = intake.take_batch(now=206.0)  # t3 and t4 were passed once: no second wait
    assert pick.batch is not None and [g.task_seq for g in pick.batch] == [6, 7]
    assert pick.retry_in is None


def test_a_batch_never_waits_when_straggler_wait_is_zero() -> None:
    intake: Intake[str] = Intake(IntakePolicy(2, 2, max_staleness=1))  # straggler_wait_s 0
    file_group(intake, 1, [0])
    file_group(intake, 2, [0])
    pick = intake.take_batch(now=1.0)
    assert pick.batch is not None and [g.task_seq for g in pick.batch] == [1, 2]
    assert intake.passed_stragglers == 0


def test_ended_tasks_are_not_stragglers() -> None:
    """Tasks that ended (trained, retired, or covered by the restored checkpoint) are never
    waited for; only open ones are."""
    intake: Intake[str] = Intake(IntakePolicy(1, 2, max_staleness=0, straggler_wait_s=9.0))
    intake.restore(CheckpointState(trainer=TrainerState(step=2), done_tasks=["run-t0", "run-t1"]))
    file_group(intake, 3, [0], rewards=(1, 0))
    assert intake.take_batch(now=0.0).retry_in == 9.0  # t2 is open
    assert intake.reject("t2", 2, "hr")[1] is not None  # rejected: it ends
    pick = intake.take_batch(now=0.5)
    assert pick.batch is not None and [g.task_seq for g in pick.batch] == [3]


def test_zero_advantage_groups_filtered() -> None:
    intake: Intake[str] = Intake(IntakePolicy(1, 2, 0, filter_zero_adv_groups=True))
    file_group(intake, 0, [0], rewards=(1, 1))  # equal rewards: no advantage
    file_group(intake, 1, [0], rewards=(1, 0))
    pick = intake.take_batch()
    assert [r.reason for r in pick.retired] == ["filtered"]
    assert pick.batch is not None and pick.batch[0].task_id == "t1"
    assert (intake.state.filtered, intake.state.returned) == (1, 1)


def test_commit_step_accounting() -> None:
    intake: Intake[str] = Intake(IntakePolicy(batch_size=2, group_size=2, max_staleness=0))
    file_group(intake, 0, [0, 0, 0])  # 2 samples x 3 tokens
    file_group(intake, 1, [0])  # 2 samples x 1 token
    pick = intake.take_batch()
    assert pick.batch is not None
    intake.commit_step(pick.batch, version=1, wall_s=7.5)
    st = intake.state
    # trained 2 groups, 4 samples, 2 * 3 + 2 * 1 = 8 tokens
    assert (st.step, st.version, st.trained, st.samples, st.tokens, st.wall_s) == (
        1,
        1,
        2,
        4,
        8,
        7.5,
    )
    acc = intake.accounting(admitted=5)
    assert (acc.trained, acc.dropped_stale, acc.filtered, acc.in_flight) == (2, 0, 0, 3)


def test_restore() -> None:
    state = TrainerState(version=4, step=4, trained=4, dropped_stale=1)
    intake: Intake[str] = Intake(IntakePolicy(1, 2, 0))
    file_group(intake, 7, [4])  # in hand before the crash: lost with it (redelivered)
    intake.restore(CheckpointState(trainer=state, done_tasks=["t0", "t3"]))
    assert intake.state == state and intake.groups == {}
    assert intake.file(group(3, [0]), "h") is Filed.ACK_NOW
    assert intake.checkpoint()[1] == []


def test_unwritten_until_a_checkpoint_covers_the_steps_and_retirements() -> None:
    intake: Intake[str] = Intake(IntakePolicy(1, 2, 0, filter_zero_adv_groups=True))
    assert not intake.unwritten  # nothing trained yet
    file_group(intake, 0, [0])
    pick = intake.take_batch()
    assert pick.batch is not None
    intake.commit_step(pick.batch, version=1, wall_s=1.0)
    assert intake.unwritten  # a trained step
    ckpt, _ = intake.checkpoint()
    assert intake.unwritten  # taken, not yet written
    intake.checkpoint_written(ckpt)
    assert not intake.unwritten
    file_group(intake, 1, [1], rewards=(1, 1))
    assert [r.reason for r in intake.take_batch().retired] == ["filtered"]
    assert intake.unwritten  # a retirement: its slot goes back with a checkpoint
    intake.checkpoint_written(intake.checkpoint()[0])
    assert not intake.unwritten
    intake.restore(CheckpointState(trainer=TrainerState(step=3, version=3)))
    assert not intake.unwritten  # restored from a written checkpoint


def test_batch_info_on_a_tiny_batch() -> None:
    intake: Intake[str] = Intake(IntakePolicy(1, 2, max_staleness=4), TrainerState(version=4))
    intake.file([scored(0, 0, [2, 2, 3], reward=1.0), scored(0, 1, [3, 3], reward=0.0)], "a")
    pick = intake.take_batch()
    assert pick.batch is not None
    info = intake.batch_info(pick.batch)
    # rewards [1, 0]: mean 0.5, population std 0.5
    assert (info.reward_mean, info.reward_std) == (0.5, 0.5)
    # 3 + 2 = 5 tokens, mean length 2.5
    assert (info.samples, info.tokens, info.gen_len_mean) == (2, 5, 2.5)
    # sample lags from oldest tokens: 4 - 2 = 2 and 4 - 3 = 1
    assert info.staleness_max == 2
    assert info.staleness_hist == {"1": 1, "2": 1}
    # token lags: 2, 2, 1, 1, 1
    assert info.staleness_hist_tokens == {"1": 3, "2": 2}
    assert (info.token_version_min, info.token_version_max) == (2, 3)
    assert (info.interrupted_frac, info.truncated_frac) == (0.0, 0.0)
    assert info.task_seqs == [0]  # the audit trail: which tasks this step trained
    assert intake.rewards(pick.batch) == [[1.0, 0.0]]


def timed(seq: int, idx: int, admitted: float, received: float, finished: float) -> ScoredSample:
    """Sample `idx` of task `t{seq}` (a group of 2) with the rollout's timestamps."""
    sc = scored(seq, idx, [0])
    t = {"admitted_at": admitted, "received_at": received, "finished_at": finished}
    return sc.model_copy(update={"sample": sc.sample.model_copy(update={"timings": t})})


def test_batch_info_says_where_the_batch_time_went() -> None:
    intake: Intake[str] = Intake(IntakePolicy(3, 2, max_staleness=1), TrainerState(version=0))
    # three tasks admitted at 100; received after 0.1, 0.2 and 0.5 s; their last samples
    # finished at 101, 102 and 105
    intake.file([timed(0, 0, 100.0, 100.1, 100.5), timed(0, 1, 100.0, 100.1, 101.0)], "a")
    intake.file([timed(1, 0, 100.0, 100.2, 102.0), timed(1, 1, 100.0, 100.2, 101.5)], "b")
    intake.file([timed(2, 0, 100.0, 100.5, 105.0), timed(2, 1, 100.0, 100.5, 103.0)], "c")
    pick = intake.take_batch()
    assert pick.batch is not None
    info = intake.batch_info(pick.batch, now=105.25)
    assert info.queue_s == 0.2  # median of 0.1, 0.2, 0.5
    assert info.gen_span_s == 4.9  # 100.1 -> 105
    assert info.tail_s == 3.0  # the median task's last sample at 102, the batch's at 105
    assert info.ready_age_s == 0.25  # taken a quarter second after its last sample
    assert intake.batch_info(pick.batch).ready_age_s is None  # no pick time given


def test_batch_timings_leave_out_samples_without_them() -> None:
    intake: Intake[str] = Intake(IntakePolicy(2, 2, max_staleness=1), TrainerState(version=0))
    file_group(intake, 0, [0])  # no timings (an older rollout)
    intake.file([timed(1, 0, 10.0, 11.0, 12.0), timed(1, 1, 10.0, 11.0, 13.0)], "b")
    pick = intake.take_batch()
    assert pick.batch is not None
    info = intake.batch_info(pick.batch, now=13.0)
    assert (info.queue_s, info.gen_span_s, info.tail_s, info.ready_age_s) == (1.0, 2.0, 0.0, 0.0)
    intake2: Intake[str] = Intake(IntakePolicy(1, 2, max_staleness=1), TrainerState(version=0))
    file_group(intake2, 0, [0])
    pick2 = intake2.take_batch()
    assert pick2.batch is not None
    info2 = intake2.batch_info(pick2.batch, now=1.0)
    assert (info2.queue_s, info2.gen_span_s, info2.tail_s, info2.ready_age_s) == (None,) * 4


def test_returned_slots_reach_admission_only_once_a_checkpoint_covers_them() -> None:
    # A trainer restored from its last written checkpoint must never report fewer returned
    # slots than admission already used: kv_state() holds retirements back until then.
    intake: Intake[str] = Intake(IntakePolicy(1, 2, max_staleness=0), TrainerState(version=2))
    file_group(intake, 0, [1, 1])  # lag 2 - 1 = 1 > η = 0: dropped
    pick = intake.take_batch()
    assert [r.task_id for r in pick.retired] == ["t0"] and pick.batch is None
    assert intake.state.dropped_stale == 1  # counted at once ...
    assert intake.retired_unwritten
    assert intake.kv_state().returned == 0  # ... but its slot is not given back yet
    assert intake.kv_state().version == 2
    ckpt, handles = intake.checkpoint()
    assert handles == ["h0"] and not intake.retired_unwritten
    assert intake.kv_state().returned == 0  # taken, not yet written
    intake.checkpoint_written(ckpt)
    assert intake.kv_state().returned == 1  # durable: the slot goes back
    restored: Intake[str] = Intake(IntakePolicy(1, 2, max_staleness=0))
    restored.restore(ckpt)
    assert restored.kv_state().returned == 1 and not restored.retired_unwritten


def episode(seq: int, idx: int, versions: list[int], reward: float = 1.0) -> ScoredSample:
    """Sample `idx` of task `t{seq}` (a group of 2), a multi-turn episode: tokens of version -1
    are environment tokens (loss mask 0), the others the model's."""
    sc = scored(seq, idx, versions, reward)
    mask = pack([int(v != -1) for v in versions], "uint8")
    return sc.model_copy(update={"sample": sc.sample.model_copy(update={"loss_mask": mask})})


def test_an_episodes_staleness_is_that_of_its_oldest_model_token() -> None:
    """Environment tokens (version -1) were made by no policy: they age nothing. Here lag is
    measured from the oldest model token: t0's is v1 (lag 3 - 1 = 2 > η = 1: dropped), t1's
    v2 (lag 1: fresh), although both hold tokens of version -1 (lag 4 if they counted)."""
    intake: Intake[str] = Intake(IntakePolicy(1, 2, max_staleness=1), TrainerState(version=3))
    t0 = [episode(0, i, [1, 1, -1, -1, 3]) for i in range(2)]
    t1 = [episode(1, 0, [2, -1, -1, 3, 3], reward=1.0), episode(1, 1, [-1, 3, -1, 3], reward=0)]
    assert intake.file(t0, "h0") is Filed.COMPLETED
    assert intake.file(t1, "h1") is Filed.COMPLETED
    pick = intake.take_batch()
    assert [(r.task_id, r.reason, r.min_version) for r in pick.retired] == [
        ("t0", "dropped_stale", 1)
    ]
    assert pick.batch is not None and [g.task_id for g in pick.batch] == ["t1"]
    assert pick.batch[0].min_version() == 2

    info = intake.batch_info(pick.batch)
    assert (info.samples, info.tokens) == (2, 9)  # every output token, the environment's too
    assert info.staleness_max == 1 and info.staleness_hist == {"0": 1, "1": 1}
    assert info.staleness_hist_tokens == {"0": 4, "1": 1}  # model tokens 2, 3, 3, 3, 3
    assert (info.token_version_min, info.token_version_max) == (2, 3)
    assert info.masked_token_frac == 4 / 9  # environment tokens / output tokens


def test_single_turn_batches_have_no_masked_tokens() -> None:
    intake: Intake[str] = Intake(IntakePolicy(1, 2, max_staleness=4), TrainerState(version=4))
    intake.file([scored(0, 0, [2, 2, 3]), scored(0, 1, [3, 3], reward=0.0)], "a")
    pick = intake.take_batch()
    assert pick.batch is not None
    assert intake.batch_info(pick.batch).masked_token_frac == 0.0


def test_batch_info_counts_turns_tool_calls_failures_and_latency() -> None:
    """Four episodes: a call that ran then an answer (2 turns, 1 call, 0.2 s); a call the tool
    refused (1 turn, 1 call, 1 error, 0.1 s); two calls, one failed (3 turns, 0.3 s); an answer
    without a call. Means over the 4 samples; tool_error_frac over the 4 calls."""
    stats = episode_stats(
        [
            make_sample(3, n_turns=2, n_tool_calls=1, tool_s=0.2),
            make_sample(3, n_turns=1, n_tool_calls=1, n_tool_errors=1, tool_s=0.1),
            make_sample(3, n_turns=3, n_tool_calls=2, n_tool_errors=1, tool_s=0.3),
            make_sample(3),
        ]
    )
    assert stats == pytest.approx(
        {
            "turns_mean": 7 / 4,
            "tool_calls_mean": 4 / 4,
            "tool_call_frac": 3 / 4,
            "tool_ok_frac": 1 / 4,  # only the first called a tool and saw no call fail
            "tool_error_frac": 2 / 4,
            "tool_s_mean": 0.6 / 4,
        }
    )
    assert episode_stats([make_sample(2)])["tool_error_frac"] == 0.0  # no call: no failure
    assert episode_stats([])["turns_mean"] == 1.0


def test_batch_info_carries_the_episode_stats() -> None:
    intake: Intake[str] = Intake(IntakePolicy(1, 2, max_staleness=4), TrainerState(version=4))
    a, b = scored(0, 0, [3, 3]), scored(0, 1, [3, 3], reward=0.0)
    a = a.model_copy(
        update={"sample": a.sample.model_copy(update={"n_turns": 2, "n_tool_calls": 1})}
    )
    intake.file([a, b], "a")
    pick = intake.take_batch()
    assert pick.batch is not None
    info = intake.batch_info(pick.batch)
    assert (info.turns_mean, info.tool_call_frac, info.tool_ok_frac) == (1.5, 0.5, 0.5)
