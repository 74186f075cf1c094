"""The trainer's rank-group entry (`areal.launch.ranks`): what each rank reads from its
environment and the config errors that come back before any rank joins a group."""

from __future__ import annotations

import pytest

from areal.config import ConfigError, load_settings
from areal.engines.rank_group import RankEnv
from areal.launch.ranks import env_rank, join_rank_group, ping_s_for


def test_rank_env_reads_torchrun_variables():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    assert RankEnv.from_env(env) == RankEnv(rank=1, world_size=2, local_rank=1)
    assert RankEnv.from_env({}) == RankEnv(0, 1, 0)  # a plain worker: one rank
    with pytest.raises(ValueError, match="0 <= RANK < WORLD_SIZE"):
        RankEnv.from_env({"RANK": "2", "WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="must be integers"):
        RankEnv.from_env({"RANK": "one"})


def test_env_rank_needs_no_torch(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    assert env_rank() == 3
    monkeypatch.delenv("RANK")
    assert env_rank() == 0


def test_the_torch_engine_on_two_ranks_is_a_config_error(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="train.engine=torch runs on one rank"):
        join_rank_group(load_settings(None, []))


def test_two_ranks_without_a_rendezvous_is_a_config_error(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ConfigError, match="MASTER_ADDR, MASTER_PORT unset"):
        join_rank_group(load_settings(None, ["train.engine=fsdp"]))


def test_one_rank_joins_nothing(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert join_rank_group(load_settings(None, ["train.engine=fsdp"])) == 1


def test_an_idle_rank0_pings_well_within_the_collective_timeout():
    assert ping_s_for(600.0) == 10.0
    assert ping_s_for(8.0) == 2.0


def test_a_rank_above_0_follows_instead_of_connecting(monkeypatch):
    from areal.launch.worker import RoleSpec, run_worker

    def never(*_a):
        raise AssertionError("a follower must not prepare or connect")

    followed: list[str] = []
    spec = RoleSpec("trainer", never, never, follow=lambda _s, wid: followed.append(wid) or 7)
    monkeypatch.setenv("RANK", "1")
    assert run_worker(spec, load_settings(None, []), "trainer-0.rank1") == 7
    assert followed == ["trainer-0.rank1"]


def test_more_cuda_ranks_than_gpus_is_a_config_error(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    settings = load_settings(None, ["train.engine=fsdp", "model.device=cuda"])
    with pytest.raises(ConfigError, match="needs GPU 1 but this host has 1"):
        join_rank_group(settings)
