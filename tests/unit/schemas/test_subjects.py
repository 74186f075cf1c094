"""Run names (`schemas.subjects`): valid ids, and names that are injective in the run id
(bug 1: `run-a`, `run_a` and `RUN_A` used to share streams and a KV bucket)."""

from __future__ import annotations

import itertools

import pytest

from schemas import subjects as S
from schemas.subjects import RunNames, run_of_stream, validate_run_id

# Every valid id of up to 3 characters over an alphabet with each kind of character (letters,
# digits, '_' and '-'), plus look-alike ids.
_ALPHABET = "ab09_-zy"
_IDS = sorted(
    {
        "".join(chars)
        for n in (1, 2, 3)
        for chars in itertools.product(_ALPHABET, repeat=n)
        if chars[0] not in "_-"
    }
    | {"run-a", "run_a", "run--a", "run__a", "run-_a", "run_-a", "a" * 64, "0" * 64}
)


def all_names(names: RunNames) -> list[str]:
    """The names of the server streams a run owns: its own, and those behind its buckets
    (JetStream keeps bucket B in stream `KV_B` / `OBJ_B`)."""
    return [names.stream(s) for s in S.ALL_STREAMS] + [
        f"KV_{names.state_bucket}",
        f"OBJ_{names.weights_bucket}",
    ]


def test_names_of_look_alike_runs_differ():
    a, b = RunNames("run-a"), RunNames("run_a")
    assert a.stream(S.PROMPTS) == "AREAL_RUN-A_PROMPTS"
    assert b.stream(S.PROMPTS) == "AREAL_RUN_A_PROMPTS"
    assert (a.state_bucket, b.state_bucket) == ("areal_run-a_state", "areal_run_a_state")
    assert (a.weights_bucket, b.weights_bucket) == ("areal_run-a_weights", "areal_run_a_weights")
    assert a.subject(S.PROMPTS) == "areal.run-a.prompts"
    assert not set(all_names(a)) & set(all_names(b))
    assert not {a.state_bucket, a.weights_bucket} & {b.state_bucket, b.weights_bucket}


def test_names_are_injective_over_many_ids():
    # 6 first characters (not '_' / '-') times 8 for each later one: 6 + 6*8 + 6*64 = 438 ids,
    # plus the 8 extras = 446 (guards that the set is as large as intended)
    assert len(_IDS) == 446
    owner: dict[str, str] = {}
    for run_id in _IDS:
        for name in all_names(RunNames(run_id)):
            # case-folded too: stream and bucket names become directories in the server's store
            assert owner.setdefault(name.casefold(), run_id) == run_id, (name, run_id)
    assert len(owner) == len(_IDS) * (len(S.ALL_STREAMS) + 2)


def test_stream_names_read_back_to_their_run():
    for run_id in _IDS:
        for stream in S.ALL_STREAMS:
            assert run_of_stream(RunNames(run_id).stream(stream)) == (run_id, stream)
    assert run_of_stream("KV_areal_run-a_state") is None
    assert run_of_stream("AREAL_RUN-A_BOGUS") is None
    assert run_of_stream("AREAL_Run-a_PROMPTS") is None  # not the image of any run id
    assert run_of_stream("AREAL_PROMPTS") is None


@pytest.mark.parametrize("bad", ["RUN_A", "Run-a", "bad.id", "", "-lead", "_lead", "a b", "a" * 65])
def test_invalid_run_ids_are_refused_with_the_rule(bad):
    with pytest.raises(ValueError) as err:
        RunNames(bad)
    msg = str(err.value)
    assert "\n" not in msg and "[a-z0-9]" in msg and "lower-case" in msg and "e.g." in msg


def test_valid_ids_pass_unchanged():
    assert validate_run_id("exp-1_b") == "exp-1_b"
    assert validate_run_id("a" * 64) == "a" * 64


def test_an_unknown_stream_has_no_name():
    with pytest.raises(ValueError, match="unknown stream"):
        RunNames("r").stream("bogus")
