"""Run configuration: pydantic-settings models composed from shared parts.

Precedence (highest first): `--set key=value` overrides, environment (`AREAL_...`, `__` for
nesting, e.g. `AREAL_ALGO__MAX_STALENESS=2`), the YAML file, defaults. Every field has a
description, a unit where it has one, and bounds; a bad config fails at start naming the field
and the fix (`ConfigError`).
"""

from __future__ import annotations

import contextvars
import difflib
import math
import os
import re
import socket
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from areal.core.watchdog import HEARTBEAT_S, MIN_FROZEN_AFTER_S
from areal.data.prompts import PromptSettings
from areal.logging import LogFormat, LogLevel

_YAML_DATA: contextvars.ContextVar[dict | None] = contextvars.ContextVar("areal_yaml", default=None)


class ConfigError(ValueError):
    pass


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _server_list(v: Any) -> Any:
    """`nats.url` given as a list of servers (YAML): the comma-separated form."""
    if isinstance(v, list | tuple):
        return ",".join(str(u).strip() for u in v)
    return v


class NatsSettings(_Part):
    url: Annotated[str | None, BeforeValidator(_server_list)] = Field(
        None,
        description="NATS server URL, or several of one cluster comma-separated "
        "(nats://a:4222,nats://b:4222,nats://c:4222: a client fails over between them); None "
        "starts an embedded nats-server (areal run only). A YAML list is taken too",
    )
    replicas: int = Field(
        1,
        ge=1,
        le=5,
        description="copies JetStream keeps of every stream, consumer and bucket of a run (a "
        "cluster of 3 servers with replicas=3 survives one server's death); 1 on a single server",
    )
    ack_wait_s: float = Field(
        30.0, gt=1, description="JetStream ack wait (s); leases heartbeat at 1/3"
    )
    max_deliver: int = Field(
        5,
        ge=1,
        description="deliveries of a message before it is dead-lettered (its task retired as "
        "rejected): its handler failed this many times, or the workers holding it stopped or "
        "died; enforced by the bus, not the server, so no message is ever left undelivered",
    )
    memory_storage: bool = Field(False, description="keep streams in memory (faster, not durable)")
    duplicate_window_s: float = Field(
        600.0,
        gt=0,
        description="JetStream de-duplication window (s): a publish retried with the same "
        "Nats-Msg-Id within it is stored once",
    )
    history_max_age_s: float = Field(
        7 * 24 * 3600.0,
        gt=0,
        description="how long the metrics, events and dlq streams keep a message (s); older "
        "ones are discarded",
    )
    history_max_msgs_per_subject: int = Field(
        100_000,
        ge=1,
        description="messages each subject of the metrics, events and dlq streams keeps (one "
        "subject per kind, e.g. metrics.trainer.step, metrics.rollout.heartbeat); the oldest "
        "go first. Reserves nothing on the server. The default keeps the step records of a "
        "100k-step run and ~2 days of one worker's heartbeats (one per 2 s per worker); raise "
        "it for longer runs or many workers when `areal top` / `tap --history` should see all",
    )
    history_max_bytes: int | None = Field(
        None,
        ge=1024 * 1024,
        description="byte cap of each of the metrics, events and dlq streams (bytes; the oldest "
        "go first); None = no byte cap and nothing reserved. nats-server reserves a stream's "
        "byte cap against its JetStream limit (max_file_store; max_memory_store with "
        "memory_storage) at creation, used or not, so each run reserves 3x this: set it only "
        "on a server sized for (concurrent runs) x 3 x this, e.g. 256 MiB for a big run on a "
        "server with several GB",
    )
    weights_keep: int = Field(
        4, ge=1, description="newest weight versions kept (object store or weights dir)"
    )
    publish_timeout_s: float = Field(
        10.0,
        gt=0,
        description="the longest wait for a JetStream publish ack (then retried with the "
        "same Nats-Msg-Id) or a run-state (KV) answer before trying again (s); the first five "
        "tries wait a fifth of it each (a request dropped during a cluster leader election "
        "is retried within 2 s of its end, not 10)",
    )
    outage_tolerance_s: float = Field(
        300.0,
        gt=0,
        description="how long a publish or run-state read/write keeps retrying while the "
        "server is unreachable (restarting, electing a leader) before the worker fails with "
        "the reason (s)",
    )
    role_lock_ttl_s: float = Field(
        15.0,
        ge=1.0,
        description="a run has one controller and one trainer: each holds a lock in the run "
        "state, renewed every 1/5 of this (s). A second one that sees it renewed exits with "
        "an error naming the holder; one whose holder stopped renewing for this long (it "
        "died) takes over. A restart under the same --worker-id takes over after 2 renewal "
        "periods. Keep it above the longest stall of a worker's event loop",
    )
    listen_host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="address the embedded nats-server (areal run without nats.url) listens on; "
        "0.0.0.0 lets workers on other hosts join (`areal worker ROLE --join RUN_ID`, with "
        "their role's credentials file from <out>/keys/nats/). The embedded server has one "
        "account per role (nats.embedded_auth) but no TLS: passwords and messages cross the "
        "network in clear; open it only on a trusted network",
    )
    listen_port: int | None = Field(
        None, ge=1, le=65535, description="port of the embedded nats-server; None = a free port"
    )
    embedded_auth: bool = Field(
        True,
        description="the embedded nats-server gets one user per role with only that role's "
        "permissions (`areal nats-config`), its credentials in <out>/keys/nats/<role>.json "
        "(0600; kept by --resume); false = no authentication: anyone who reaches "
        "nats.listen_host may read, write and delete every run on the server",
    )
    credentials_file: str | None = Field(
        None,
        description="credentials this process connects with: a JSON file written by `areal "
        "nats-config` or `areal run` (<out>/keys/nats/<role>.json), or a NATS .creds file; "
        "wins over nats.credentials_dir; None = none (or the URL's user:password)",
    )
    credentials_dir: str | None = Field(
        None,
        description="dir of per-role credentials files (<role>.json, as `areal nats-config "
        "--out DIR` writes them): each worker uses its own role's file; `areal run` sets it "
        "to <out>/keys/nats for its embedded server",
    )
    tls_ca_file: str | None = Field(
        None,
        description="CA certificate (PEM) the client trusts for the server's TLS; None = "
        "the system's CAs (a tls:// URL) or no TLS",
    )
    tls_cert_file: str | None = Field(
        None, description="client certificate (PEM) for a server that verifies clients (mTLS)"
    )
    tls_key_file: str | None = Field(None, description="private key (PEM) of nats.tls_cert_file")
    share_max_bytes: int = Field(
        1024 * 1024 * 1024,
        ge=0,
        description="most bytes `areal run` uploads to the run's files bucket (the model dir, "
        "then the data file) so that `areal worker ROLE --join RUN_ID` works on another host "
        "(bytes); the default, 1 GiB, holds a bf16 model of up to ~0.5B parameters "
        "(SmolLM2-135M: 273 MB); larger ones are not shared (give those hosts a local copy and "
        "--set model.path=... / data.source=...); the bucket has no byte cap, so this is disk "
        "on the NATS server and upload time at launch; 0 = share only the config",
    )


class WeightsSettings(_Part):
    transport: Literal["auto", "object_store", "file"] = Field(
        "auto",
        description="object_store: weights travel through JetStream's object store; "
        "file: written under weights.dir (a filesystem every rollout worker sees); auto: "
        "`areal run` picks file when no other host can reach its NATS server (embedded on "
        "loopback, or a loopback nats.url: every worker shares this host's disk), else "
        "object_store; a worker started on its own (`areal worker`) takes object_store",
    )
    dir: str | None = Field(
        None,
        description="weights dir for transport=file; None = <out_dir>/weights. Rollout "
        "workers load file:// weights only from regular files under it (symlinks resolved)",
    )
    wire_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="dtype of floating weights on the wire: auto = as the trainer holds them "
        "(model.dtype); bfloat16 halves the bytes of fp32 masters (each tensor cast as it "
        "streams out; rollout engines load into their own dtype). float16 overflows past "
        "65504 (a rollout refuses the inf): prefer bfloat16",
    )
    overlap_max_mib: float = Field(
        256.0,
        ge=0,
        description="weights up to this size on the wire are copied to host memory after each "
        "step and uploaded while the next step trains (a small model's publish leaves the "
        "step's critical path); larger ones stream out in line with no copy. 0 = always in line",
    )

    def resolve_transport(self, other_hosts_can_join: bool) -> None:
        """Settle `transport: auto` for a run that `areal run` starts (before its config is
        written and shared): weights as files when every worker must run on this host (a
        local file is written and read at memory speed; through the object store the same
        bytes cross the NATS server twice per version), else the object store."""
        if self.transport == "auto":
            self.transport = "object_store" if other_hosts_can_join else "file"

    def file_dir(self, out_dir: str) -> str | None:
        """The dir of file:// weights (transport=file), None for the object store (an
        unresolved auto is the object store: see `resolve_transport`)."""
        if self.transport != "file":
            return None
        return self.dir or f"{out_dir}/weights"


class SecuritySettings(_Part):
    keys_dir: str | None = Field(
        None,
        description="dir of the run's keys (areal.security.keys): the trainer's weights "
        "signing key, its verify key, the message-id secret; None = <out_dir>/keys, created "
        "by `areal run` before any worker starts and kept on --resume. A worker on another "
        "host needs a copy without weights_signing.key (--set security.keys_dir=DIR)",
    )
    sign_weights: bool = Field(
        True,
        description="the trainer signs every weight announcement and rollout workers load only "
        "announcements it signed; false = unsigned weights, trusted from anyone who can "
        "publish on the bus (only for a bus no one else can write to; logged as a warning)",
    )


class ModelSettings(_Part):
    path: str | None = Field(
        None, description="local Hugging Face model dir; None = built-in tiny preset (warm-started)"
    )
    preset: Literal["tiny", "small"] = Field(
        "tiny",
        description="built-in model size when path is unset: tiny (~0.4M params) or small "
        "(~3.2M, for benchmarks)",
    )
    warm_start_steps: int | None = Field(
        None,
        ge=0,
        description="supervised steps that warm-start the tiny preset (cached); None = task default",
    )
    warm_start_label_smoothing: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="label smoothing of the warm start's supervised loss; None = task default "
        "(0.1 for arithmetic, 0 otherwise). Smoothing leaves the model right when decoding "
        "greedily but unsure when sampling hot: the regime where RL sharpens it fast",
    )
    warm_start_source: str | None = Field(
        None,
        description="data the tiny preset's warm start trains on (a synthetic:<task> or a "
        ".jsonl / .parquet file with data.prompt_field / data.answer_field and, optionally, "
        "a `target` completion per record); None = data.source. Give it problems of the same "
        "kind as data.source but not its own: warm-started on the very items RL then trains "
        "on, the model starts near its final reward and shows no learning",
    )
    warm_start_lock_timeout_s: float = Field(
        900.0,
        gt=0,
        description="most seconds to wait while another process builds the same warm-started "
        "model (its holder and the wait are logged every 15 s); then the run fails naming it",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="weights dtype")
    device: str = Field("cpu", description="torch device for both engines, e.g. cpu or cuda")


class DataSettings(_Part):
    source: str = Field(
        "synthetic:arithmetic",
        description="synthetic:arithmetic | synthetic:running_sum | synthetic:tool_arithmetic | "
        "reasoning_gym:<generator> | champ[:file.json] | humaneval[:file.jsonl] | path to "
        ".jsonl / .parquet | hf:<save_to_disk folder, folder or glob of .parquet/.arrow "
        "shards, or a hub dataset name in the local cache (never downloaded)>",
    )
    prompt_field: str = Field(
        "prompt",
        description="prompt field of JSONL/Parquet/hf: records (GSM8K: question, DeepScaleR: "
        "problem)",
    )
    answer_field: str = Field(
        "answer", description="answer field of JSONL/Parquet/hf: records (code: tests)"
    )
    split: str = Field(
        "train", min_length=1, description="hf: sources: the split data.source reads"
    )
    eval_split: str = Field(
        "test", min_length=1, description="hf: sources: the split data.eval_source reads"
    )
    subset: str | None = Field(
        None,
        description="hf: hub datasets with several subsets (configurations): the one to read, "
        "e.g. main for openai/gsm8k; None = the only or default one",
    )
    task_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="options of a synthetic task or parameters of a reasoning_gym generator",
    )
    shuffle: bool = Field(
        True, description="finite sources: a new seeded order of the records every epoch"
    )
    eval_size: int = Field(
        0,
        ge=0,
        description="items held out of the training data for evaluation (eval.every_versions); "
        "0 = none (or all of a finite data.eval_source)",
    )
    eval_source: str | None = Field(
        None,
        description="a separate held-out source (any data.source form); None = split "
        "data.eval_size items off data.source",
    )
    split_seed: int = Field(
        0,
        ge=0,
        description="seed of the held-out split of a finite source (independent of the run "
        "seed, so runs with different seeds evaluate on the same items)",
    )


# the advantage each old (algo.adv_norm_std, algo.adv_batch_norm) pair meant
_OLD_ADV_FLAGS = {(True, False): "grpo", (False, False): "dr_grpo", (False, True): "reinforce_pp"}


class AlgoSettings(_Part):
    batch_size: int = Field(8, ge=1, description="B: tasks (prompts) per training step")
    group_size: int = Field(8, ge=1, description="G: samples per task (GRPO group)")
    max_staleness: int = Field(4, ge=0, description="η: max policy-version lag; 0 = synchronous RL")
    decoupled: bool = Field(True, description="decoupled PPO (AReaL eq. 5); false = standard PPO")
    prox_logp: Literal["recompute", "loglinear"] = Field(
        "recompute", description="how the proximal policy's log-probs are obtained"
    )
    eps_clip_low: float = Field(0.2, gt=0, lt=1, description="PPO clip range below 1")
    eps_clip_high: float = Field(0.2, gt=0, description="PPO clip range above 1")
    behav_imp_weight_cap: float | None = Field(
        5.0,
        gt=1,
        description="upper bound of the behaviour importance weight w = exp(prox - behav): "
        "tokens above it are dropped (behav_imp_weight_mode=mask) or clamped to it (truncate); "
        "None = no upper bound",
    )
    behav_imp_weight_floor: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="lower bound of w, handled as the cap (MIS/TIS lower bound); None = none",
    )
    behav_imp_weight_level: Literal["token", "sequence", "geometric"] = Field(
        "token",
        description="what the bounds judge (areal.algo.behav_weight): token (each w_t, AReaL), "
        "sequence (the sample's product of w_t), geometric (its geometric mean: one long answer "
        "is judged as a short one)",
    )
    behav_imp_weight_mode: Literal["mask", "truncate"] = Field(
        "mask",
        description="outside the bounds: mask (drop the token, or the sample's tokens; MIS, "
        "AReaL's cap) or truncate (clamp the weight into the bounds and keep it; TIS)",
    )
    m2po_tau: float | None = Field(
        None,
        gt=0,
        description="M2PO (arXiv 2510.01161): drop the tokens of largest (log w)^2 until the "
        "mean (log w)^2 of those kept is at most this (0.04 in the paper), per micro-batch; "
        "None = off",
    )
    lr_lag_decay: float = Field(
        0.0,
        ge=0,
        description="staleness-aware step (areal.algo.stale_step): each step's lr is train.lr / "
        "(1 + this * the mean version lag of its loss tokens), so raising max_staleness does not "
        "silently raise the effective step; 1 = the delayed-gradient rule (data k versions old "
        "steps 1/(1+k) as far); 0 = off",
    )
    loss: str = Field(
        "ppo",
        min_length=1,
        description="the objective (areal.algo.registry): ppo (decoupled PPO, AReaL eq. 5), "
        "gspo (GSPO: sequence-level ratio and clip), or pkg.mod:fn (your own `fn(inp: "
        "LossInput, cfg) -> LossOutput | scalar tensor`)",
    )
    loss_norm: Literal["token", "sequence", "constant"] = Field(
        "token",
        description="what a minibatch's summed token losses are divided by: token (its loss "
        "tokens, DAPO), sequence (each sample's mean, then the mean over samples, GRPO), "
        "constant (samples x algo.loss_norm_tokens, Dr. GRPO)",
    )
    loss_norm_tokens: int | None = Field(
        None,
        ge=1,
        description="loss_norm=constant: tokens per sample in the constant; None = "
        "rollout.max_new_tokens * rollout.max_turns (the generation budget)",
    )
    gspo_eps_clip_low: float = Field(
        3e-4, gt=0, lt=1, description="loss=gspo: clip range of the sequence ratio below 1"
    )
    gspo_eps_clip_high: float = Field(
        4e-4, gt=0, description="loss=gspo: clip range of the sequence ratio above 1"
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="weight of the KL to a frozen reference model (the initial weights) added "
        "to each loss token's loss; 0 = off, and no reference model is loaded",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="estimator of KL(policy || reference) per token, log_r = ref - logp: k1 = "
        "-log_r, k2 = log_r^2 / 2, k3 = exp(log_r) - 1 - log_r (Schulman; GRPO's)",
    )
    advantage: str = Field(
        "grpo",
        min_length=1,
        description="advantage estimator: grpo (group mean and std), dr_grpo (group mean only), "
        "rloo (leave-one-out mean), reinforce_pp (group mean, then whitened over the batch), "
        "or pkg.mod:fn (your own `fn(rewards [groups, G]) -> advantages [groups, G]`)",
    )
    filter_zero_adv_groups: bool = Field(
        False, description="drop groups whose rewards are all equal (their slot is returned)"
    )
    straggler_wait_s: float = Field(
        30.0,
        ge=0,
        description="how long a step waits for an older task still generating before it trains "
        "on newer groups instead; a skipped task usually goes stale and is dropped, its "
        "generation wasted and the long answers it stands for left out of training. The wait "
        "only bounds a lost or stuck task (a dead rollout's tasks come back after "
        "nats.ack_wait_s); 0 = never wait (the oldest B complete groups, whatever is open)",
    )

    @model_validator(mode="before")
    @classmethod
    def _old_advantage_flags(cls, data: Any) -> Any:
        """`adv_norm_std` / `adv_batch_norm` became `algo.advantage`: still read where they
        say what `advantage` says (an old run's config.json), refused with the fix otherwise."""
        if not isinstance(data, dict) or not {"adv_norm_std", "adv_batch_norm"} & data.keys():
            return data
        data = dict(data)
        flags = (bool(data.pop("adv_norm_std", True)), bool(data.pop("adv_batch_norm", False)))
        meant = _OLD_ADV_FLAGS.get(flags)
        if meant is None or meant != data.get("advantage", "grpo"):
            fix = (
                f"set algo.advantage: {meant}"
                if meant is not None
                else "use algo.advantage: reinforce_pp (group mean, batch whitening) or your "
                "own pkg.mod:fn"
            )
            raise ValueError(
                f"algo.adv_norm_std={flags[0]} / algo.adv_batch_norm={flags[1]} were replaced "
                f"by algo.advantage: {fix} and remove them"
            )
        return data

    @model_validator(mode="after")
    def _registry_specs(self) -> AlgoSettings:
        from areal.algo.names import ADVANTAGE_NAMES, LOSS_NAMES

        for name, spec, builtin in (
            ("loss", self.loss, LOSS_NAMES),
            ("advantage", self.advantage, ADVANTAGE_NAMES),
        ):
            mod, sep, attr = spec.partition(":")
            if spec not in builtin and not (sep and mod and attr):
                raise ValueError(
                    f"algo.{name}={spec!r}: use one of {', '.join(builtin)}, or "
                    "'pkg.module:function' for your own"
                )
        return self


class RolloutSettings(_Part):
    engine: Literal["torch", "vllm"] = Field("torch", description="inference engine")
    max_new_tokens: int = Field(16, ge=1, le=32768, description="generated tokens per sample, max")
    temperature: float = Field(1.0, ge=0, description="sampling temperature (0 = greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling mass")
    interruptible: bool = Field(
        True, description="switch weights mid-sample (re-prefill); false = finish on old weights"
    )
    interrupt_min_interval_s: float = Field(
        0.0,
        ge=0,
        description="min seconds between mid-batch weight switches (each re-prefills "
        "the batch); 0 = switch at every new version",
    )
    needed_first: bool = Field(
        False,
        description="while the trainer's next batch has samples left to generate on a worker, "
        "start no task of a later batch there: its slowest answers decode alone and the "
        "trainer's wait for them ends sooner (async runs; no effect at max_staleness 0)",
    )
    max_concurrent_tasks: int = Field(4, ge=1, description="tasks one rollout worker holds at once")
    max_batch_size: int = Field(
        64, ge=1, description="sequences decoded together (continuous batch)"
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads per rollout worker")
    overlong: Literal["score", "mask", "penalty"] = Field(
        "score",
        description="samples cut at max_new_tokens: score (truncated and scored as they are), "
        "mask (kept out of the loss, their group's slot still used), penalty (DAPO's soft "
        "overlong punishment added to the reward over the last overlong_buffer tokens)",
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="penalty mode: tokens before max_new_tokens where the penalty ramps from 0 "
        "to -overlong_penalty (DAPO's L_cache); 0 = only a cut sample is penalised",
    )
    overlong_penalty: float = Field(
        1.0, ge=0, description="penalty mode: the reward taken off a sample cut at the limit"
    )
    workflow: str = Field(
        "single_turn",
        min_length=1,
        description="what one sample is: single_turn (one generation), tool_call (a multi-turn "
        "episode calling tools), or pkg.mod:Name (your class with `async arun_episode(gen, "
        "task, sample_idx) -> Episode`)",
    )
    workflow_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the workflow's class"
    )
    max_turns: int = Field(
        1,
        ge=1,
        le=1024,
        description="model generations per episode, max (each at most max_new_tokens); an "
        "episode's model tokens are at most max_new_tokens * max_turns",
    )
    max_episode_tokens: int | None = Field(
        None,
        ge=1,
        le=2**24,
        description="tokens of an episode after its prompt, model and environment (tool "
        "output, user turns) together, max; None = 2 * max_new_tokens * max_turns (as many "
        "environment tokens as model tokens). At least max_new_tokens; the model's context "
        "bounds prompt + episode too",
    )

    @model_validator(mode="after")
    def _episode_fits_a_turn(self) -> RolloutSettings:
        if self.max_episode_tokens is not None and self.max_episode_tokens < self.max_new_tokens:
            raise ValueError(
                f"rollout.max_episode_tokens={self.max_episode_tokens} is below "
                f"rollout.max_new_tokens={self.max_new_tokens}: one full turn must fit an "
                "episode; raise it or lower max_new_tokens"
            )
        return self

    @property
    def episode_tokens(self) -> int:
        """`max_episode_tokens`, its default resolved: tokens an episode may hold after its
        prompt."""
        if self.max_episode_tokens is not None:
            return self.max_episode_tokens
        return 2 * self.max_new_tokens * self.max_turns

    def sample_limits(self) -> dict[str, int]:
        """What a sample of this run may hold (`areal.core.validate.Bounds` fields)."""
        return {
            "max_new_tokens": self.max_new_tokens,
            "max_turns": self.max_turns,
            "max_episode_tokens": self.episode_tokens,
        }


class EvalSettings(_Part):
    every_versions: int = Field(
        0,
        ge=0,
        description="evaluate the held-out set (data.eval_size items) at every K-th policy "
        "version, on the rollout workers, while training goes on; 0 = never",
    )
    temperature: float = Field(0.0, ge=0, description="eval sampling temperature (0 = greedy)")
    max_new_tokens: int | None = Field(
        None, ge=1, le=32768, description="eval generation cap; None = rollout.max_new_tokens"
    )
    final_wait_s: float = Field(
        300.0,
        ge=0,
        description="when the final policy version is a multiple of every_versions (e.g. "
        "train.total_steps is), the trainer waits up to this long (s) at the end for the round "
        "on the final weights, so eval.jsonl ends with the final model; 0 = end without it",
    )


class RewardSettings(_Part):
    fn: str | None = Field(
        None,
        description="arithmetic | running_sum | math | code | module:function; None = task default",
    )
    timeout_s: float = Field(
        10.0,
        gt=0,
        description="per-sample scoring timeout (s): a sample scored past it gets reward 0, "
        "the rest of its batch is unaffected",
    )
    pool_workers: int = Field(1, ge=1, description="scoring processes per reward worker")
    batch_size: int = Field(
        32, ge=1, description="samples scored per pool call (those waiting are batched)"
    )
    range: tuple[float, float] | None = Field(
        None,
        description="[lo, hi]: the scores your scorer can give; a score outside it counts as a "
        "scorer error (reward 0) and a reward outside it (plus the overlong penalty) is never "
        "trained on. None: [0, 1] for the built-in scorers, any finite value for your own",
    )

    @model_validator(mode="after")
    def _range_ordered(self) -> RewardSettings:
        if self.range is not None:
            lo, hi = self.range
            if not (math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
                raise ValueError(
                    f"reward.range {list(self.range)} must be finite [lo, hi], lo <= hi"
                )
        return self


# The largest train.lora.alpha, and of the alpha a rollout accepts with a received adapter
# (`areal.engines.lora.check_adapter`): usual values are r to 2r (16-512); 1e4 leaves room
# for any sane choice and keeps (alpha / r) B A far from float32's range.
MAX_LORA_ALPHA = 1e4


class LoraSettings(_Part):
    """A LoRA adapter (`train.lora`): only it trains and only it is published per version."""

    r: int = Field(16, ge=1, le=1024, description="rank of the adapter's A [r, in] and B [out, r]")
    alpha: float = Field(
        32.0,
        gt=0,
        le=MAX_LORA_ALPHA,
        allow_inf_nan=False,
        description="scale of the update: W = W0 + (alpha / r) B A, by alpha / r; finite, "
        f"in (0, {MAX_LORA_ALPHA:g}] (a rollout refuses an adapter past it)",
    )
    dropout: float = Field(
        0.0, ge=0, lt=1, description="dropout on the adapter's input in the loss forward only"
    )
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"],
        min_length=1,
        description="linear layers to adapt, by name suffix (PEFT target_modules): q_proj, "
        "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj for Llama/Qwen2 models",
    )


class TrainSettings(_Part):
    engine: Literal["torch", "fsdp", "deepspeed"] = Field(
        "torch",
        description="training engine: torch (one process), fsdp (FSDP2, one or more ranks), "
        "deepspeed (ZeRO-1/2/3, one or more ranks; pip install 'areal-bus[deepspeed]')",
    )
    nproc: int = Field(
        1,
        ge=1,
        description="trainer ranks `areal run` starts on this host (rank 0 alone talks to the "
        "bus); > 1 needs train.engine fsdp or deepspeed. Under torchrun, WORLD_SIZE decides",
    )
    dist_timeout_s: float = Field(
        600.0,
        gt=0,
        description="most seconds a trainer rank waits in one collective before the group "
        "fails and is restarted from its checkpoint (a dead rank is noticed at once)",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="recompute each decoder layer in backward, less memory (fsdp, deepspeed)",
    )
    activation_offload: bool = Field(
        False, description="keep saved activations in pinned CPU memory (fsdp on CUDA)"
    )
    record_batches: bool = Field(
        False,
        description="write each step's batch to <out_dir>/batches/step-<version>.pt before "
        "training on it (areal.engines.record: replay it through another engine, e.g. to "
        "check a multi-rank engine against one process on the pipeline's own batches). About "
        "batch_size x group_size sequences per step on disk: for checks and debugging",
    )
    zero_stage: int = Field(
        2,
        ge=1,
        le=3,
        description="DeepSpeed ZeRO stage (deepspeed only): 1 shards optimizer states, 2 also "
        "gradients, 3 also parameters",
    )
    total_steps: int = Field(40, ge=1, description="training steps (policy versions) to run")
    lr: float = Field(2e-4, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="max global grad norm")
    n_minibatches: int = Field(
        2, ge=1, description="optimizer steps per training step (PPO minibatches)"
    )
    max_tokens_per_mb: int = Field(4096, ge=16, description="token budget per packed micro-batch")
    packing: Literal["ffd", "fixed"] = Field(
        "ffd", description="dynamic (ffd) or fixed micro-batches"
    )
    fixed_mb_size: int = Field(8, ge=1, description="sequences per micro-batch when packing=fixed")
    share_prompts: bool = Field(
        True,
        description="packing=ffd: the samples of a micro-batch that share a prompt (a group) "
        "carry it once, so its tokens go through the model once, not group_size times (same "
        "log-probs and gradients)",
    )
    checkpoint_every: int = Field(1, ge=1, description="steps between trainer checkpoints")
    storage_pause_max_s: float | None = Field(
        None,
        gt=0,
        description="how long a trainer write failing on a full or failing disk (weights, "
        "checkpoint, metrics, summary, final model) pauses training, retried with backoff, "
        "before the trainer stops with the reason (s); None = until the write lands",
    )
    torch_threads: int = Field(1, ge=1, description="torch intra-op threads for the trainer")
    lora: LoraSettings | None = Field(
        None,
        description="train a LoRA adapter instead of the full weights (every engine, deepspeed "
        "with zero_stage 1 or 2; pip install 'areal-bus[lora]'): rollouts receive only the "
        "adapter per version, final/ holds the merged model and adapter/; None = full weights",
    )

    @model_validator(mode="after")
    def _ranks_need_a_distributed_engine(self) -> TrainSettings:
        if self.nproc > 1 and self.engine == "torch":
            raise ValueError(
                f"train.nproc={self.nproc} needs a distributed engine: set train.engine=fsdp "
                "or deepspeed, or train.nproc=1"
            )
        if self.lora is not None and self.engine == "deepspeed" and self.zero_stage == 3:
            raise ValueError(
                "train.lora with train.engine=deepspeed needs train.zero_stage 1 or 2 (ZeRO-3 "
                "partitions the base weights): set train.zero_stage=2, or train.engine=fsdp"
            )
        return self


class WatchdogSettings(_Part):
    """Liveness of the workers (`areal.core.watchdog`; `areal run` runs the watchdog)."""

    frozen_after_s: float = Field(
        30.0,
        ge=MIN_FROZEN_AFTER_S,
        le=86400.0,
        description=f"a worker whose heartbeats (one every {HEARTBEAT_S:g} s) stop for this "
        "long is named frozen: a `worker_frozen` event, and `areal run` SIGKILLs and restarts "
        f"it (s; at least {MIN_FROZEN_AFTER_S:g}, 2.5 heartbeats). The work it held comes "
        "back nats.ack_wait_s after its last lease heartbeat, killed or not",
    )
    startup_s: float = Field(
        1800.0,
        ge=MIN_FROZEN_AFTER_S,
        le=86400.0,
        description="the same for a worker `areal run` started that has sent no heartbeat "
        "yet: model load, warm start, waiting for the run's streams or for its role lock (s; "
        "frozen_after_s when that is longer)",
    )


TrackerName = Literal["tensorboard", "wandb", "mlflow"]


class TrackingSettings(_Part):
    """Experiment trackers the trainer logs to: every step record, every eval round and the run's
    config (`areal.tracking`). `tracking: [tensorboard, wandb]` is short for
    `tracking: {backends: [tensorboard, wandb]}`. A tracker that fails warns once and is
    switched off; training never waits for one."""

    backends: list[TrackerName] = Field(
        default_factory=list,
        description="trackers to log to: tensorboard (event files in <out_dir>/tb), wandb "
        "(Weights & Biases; offline files in <out_dir>/wandb without an API key), mlflow "
        "(mlflow_uri); pip install 'areal-bus[tracking]'. Empty = none",
    )
    project: str = Field(
        "areal-bus", min_length=1, description="W&B project and MLflow experiment name"
    )
    run_name: str | None = Field(
        None, description="the run's name in W&B and MLflow; None = the name of out_dir"
    )
    tags: list[str] = Field(
        default_factory=list, description="W&B tags; MLflow tags (each with the value 'true')"
    )
    mlflow_uri: str | None = Field(
        None,
        description="MLflow tracking URI (http://host:5000, sqlite:///mlflow.db, a dir); "
        "None = a file store in <out_dir>/mlruns",
    )
    wandb_mode: Literal["auto", "online", "offline"] = Field(
        "auto",
        description="auto: online when an API key is found (WANDB_API_KEY or `wandb login`) "
        "and WANDB_MODE does not say otherwise, else offline (`wandb sync` the run dir later)",
    )
    queue_size: int = Field(
        1000,
        ge=1,
        le=1_000_000,
        description="records waiting per tracker; past it new records are dropped and counted "
        "(a tracker slower than training never holds the trainer back)",
    )
    close_timeout_s: float = Field(
        10.0,
        ge=0,
        le=600,
        description="at the run's end, how long the trainer waits for the trackers to write "
        "what is queued and close (s, all together); a tracker still busy then is left behind",
    )

    @model_validator(mode="before")
    @classmethod
    def _list_is_backends(cls, v: Any) -> Any:
        """`tracking: [tensorboard, wandb]` or `--set tracking=tensorboard,mlflow`."""
        if isinstance(v, str):
            v = [b.strip() for b in v.split(",") if b.strip()]
        if isinstance(v, list | tuple):
            return {"backends": list(v)}
        return v

    @model_validator(mode="after")
    def _no_repeats(self) -> TrackingSettings:
        if len(set(self.backends)) != len(self.backends):
            raise ValueError(f"tracking.backends {self.backends} names a tracker twice")
        return self


def _upper(v: object) -> object:
    return v.upper() if isinstance(v, str) else v


# `AREAL_LOG_LEVEL=debug` works as well as `DEBUG`
LogLevelField = Annotated[LogLevel, BeforeValidator(_upper)]
# the processes `areal run` starts, by what `cpu_affinity` calls them ("other": the rest)
AffinityRole = Literal["rollout", "trainer", "reward", "controller", "nats", "launcher", "other"]
# a cpu list; YAML reads a lone core ("1") as a number
CpuList = Annotated[str, BeforeValidator(lambda v: str(v) if isinstance(v, int) else v)]
LOG_LEVEL_HELP = "least severe log events shown: DEBUG | INFO | WARNING | ERROR (any case)"
LOG_FORMAT_HELP = "console: for humans (colours on a TTY); json: one object per line (containers)"


class RunSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="AREAL_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    run_id: str = Field("areal", description="namespace of the run on the bus (subjects, streams)")
    seed: int = Field(0, ge=0, description="seed for data order, sampling and init")
    out_dir: str = Field("runs/latest", description="metrics.jsonl, summary.json, checkpoints")
    replicas: dict[Literal["rollout", "reward"], int] = Field(
        default_factory=lambda: {"rollout": 1, "reward": 1},
        description="worker processes per role started by `areal run`",
    )
    cpu_affinity: dict[AffinityRole, CpuList] = Field(
        default_factory=dict,
        description="cores of each process `areal run` starts on this host (Linux), as a cpu "
        "list ('0', '1-3', '0,2'): keys rollout, trainer (every rank), reward, controller, "
        "nats (the embedded server), launcher, and other (every one not named); a process "
        "with no entry runs where the OS puts it. E.g. {rollout: '0', trainer: '1', other: "
        "'0-1'} keeps the two model roles off each other's core",
    )
    log_level: LogLevelField = Field("INFO", description=LOG_LEVEL_HELP)
    log_format: LogFormat = Field("console", description=LOG_FORMAT_HELP)
    cache_dir: str | None = Field(
        None,
        description="dir of built models (the warm-started presets, one subdir each); "
        "None = ~/.cache/areal-bus/models",
    )
    nats: NatsSettings = Field(default_factory=NatsSettings)
    model: ModelSettings = Field(default_factory=ModelSettings)
    weights: WeightsSettings = Field(default_factory=WeightsSettings)
    security: SecuritySettings = Field(default_factory=SecuritySettings)
    data: DataSettings = Field(default_factory=DataSettings)
    prompt: PromptSettings = Field(default_factory=PromptSettings)
    algo: AlgoSettings = Field(default_factory=AlgoSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    reward: RewardSettings = Field(default_factory=RewardSettings)
    train: TrainSettings = Field(default_factory=TrainSettings)
    eval: EvalSettings = Field(default_factory=EvalSettings)
    watchdog: WatchdogSettings = Field(default_factory=WatchdogSettings)
    tracking: TrackingSettings = Field(default_factory=TrackingSettings)

    @classmethod
    def settings_customise_sources(
        cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlSource(settings_cls))

    @model_validator(mode="after")
    def _cross_checks(self) -> RunSettings:
        from schemas.subjects import validate_run_id

        validate_run_id(self.run_id)
        for role, n in self.replicas.items():
            if n < 1:
                raise ValueError(f"replicas.{role} must be >= 1 (got {n})")
        from areal.proc import parse_cpu_list

        for role, cpus in self.cpu_affinity.items():
            try:
                parse_cpu_list(cpus)
            except ValueError as e:
                raise ValueError(f"cpu_affinity.{role}: {e}") from None
        n_seqs = self.algo.batch_size * self.algo.group_size
        if self.train.n_minibatches > n_seqs:
            raise ValueError(
                f"train.n_minibatches={self.train.n_minibatches} exceeds the "
                f"{n_seqs} samples of a step (algo.batch_size * algo.group_size)"
            )
        if self.model.path is not None and not Path(self.model.path).is_dir():
            raise ValueError(
                f"model.path {self.model.path!r} is not a directory on this host; a worker on "
                "another host joins with `areal worker ROLE --join RUN_ID --nats-url URL` "
                "(fetches the run's model) or --set model.path=<a local copy>"
            )
        from areal.data.sources import source_error

        for name in ("source", "eval_source"):
            spec = getattr(self.data, name)
            problem = spec is not None and source_error(spec)
            if problem:
                raise ValueError(f"data.{name}: {problem}")
        warm = self.model.warm_start_source
        if warm is not None and self.model.path is None and (problem := source_error(warm)):
            raise ValueError(f"model.warm_start_source: {problem}")
        d = self.data
        if d.source.startswith("hf:") and d.eval_source == d.source and d.eval_split == d.split:
            raise ValueError(
                f"data.eval_source reads split {d.split!r} of {d.source}, which data.source "
                "trains on: set data.eval_split to another split (e.g. test), or drop "
                "data.eval_source and hold out data.eval_size items"
            )
        if self.eval.every_versions and not (self.data.eval_size or self.data.eval_source):
            raise ValueError(
                f"eval.every_versions={self.eval.every_versions} but the run has no held-out "
                "set: set data.eval_size (items held out of the training data) or "
                "data.eval_source, or eval.every_versions=0"
            )
        return self

    def cpus_of(self, role: str) -> frozenset[int] | None:
        """The cores `cpu_affinity` gives `role` (a key of it), or None: not pinned."""
        from areal.proc import parse_cpu_list

        spec = self.cpu_affinity.get(role, self.cpu_affinity.get("other"))  # type: ignore[call-overload]
        return parse_cpu_list(spec) if spec is not None else None

    def reward_fn_name(self) -> str:
        from areal.rewards.registry import default_reward_for

        return self.reward.fn or default_reward_for(self.data.source)

    def score_range(self) -> tuple[float, float]:
        """What the scorer may return (`reward.range`, or [0, 1] for a built-in scorer)."""
        from areal.rewards.registry import BUILTIN_REWARDS

        if self.reward.range is not None:
            return self.reward.range
        return (0.0, 1.0) if self.reward_fn_name() in BUILTIN_REWARDS else (-math.inf, math.inf)

    def reward_range(self) -> tuple[float, float]:
        """What a published reward may be: the score plus the overlong penalty, if any."""
        lo, hi = self.score_range()
        if self.rollout.overlong == "penalty":
            lo -= self.rollout.overlong_penalty
        return lo, hi


class _YamlSource(PydanticBaseSettingsSource):
    def get_field_value(self, field, field_name):  # pragma: no cover - unused by __call__
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return _YAML_DATA.get() or {}


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`a.b=c` strings -> nested dict; values parsed as YAML scalars (`true`, `3`, `[1,2]`).

    A malformed item (no `=`, an empty key part) or two items that disagree on whether a key is
    a section (`--set algo=1 --set algo.batch_size=2`) is a `ConfigError` naming the item."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(
                f"--set {item!r}: expected key=value, e.g. --set algo.max_staleness=2"
            )
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(p.strip() for p in parts):
            raise ConfigError(
                f"--set {item!r}: the key has an empty part; expected e.g. algo.max_staleness=2"
            )
        node = out
        for i, p in enumerate(parts[:-1]):
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"--set {item!r}: {'.'.join(parts[: i + 1])} was already set to a value; "
                    "set either the section's fields or the whole section, not both"
                )
            node = child
        if isinstance(node.get(parts[-1]), dict):
            raise ConfigError(
                f"--set {item!r}: {key.strip()} is a section whose fields are set too; "
                "set either the section's fields or the whole section, not both"
            )
        node[parts[-1]] = yaml.safe_load(raw) if raw != "" else None
    return out


def _section_model(loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The settings model of section `loc` of `RunSettings` (None when `loc` is not one)."""
    model: type[BaseModel] = RunSettings
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = field.annotation if field is not None else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        model = ann
    return model


def _all_keys(model: type[BaseModel] = RunSettings, prefix: str = "") -> list[str]:
    """Every dotted setting name of `model` (`algo.max_staleness`, ...), sections included."""
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _all_keys(ann, f"{prefix}{name}.")
    return keys


def suggest_key(loc: tuple[int | str, ...]) -> str | None:
    """The setting an unknown key `loc` most likely meant (difflib): a sibling with a close name
    (`algo.max_stalenes` -> `algo.max_staleness`), else a setting of that name in another
    section (`max_staleness` -> `algo.max_staleness`); None when nothing is close."""
    *parent, name = (str(p) for p in loc)
    section = _section_model(tuple(parent))
    if section is not None:
        close = difflib.get_close_matches(name, list(section.model_fields), n=1, cutoff=0.6)
        if close:
            return ".".join([*parent, close[0]])
    by_leaf: dict[str, str] = {}
    for key in _all_keys():
        by_leaf.setdefault(key.rsplit(".", 1)[-1], key)
    close = difflib.get_close_matches(name, list(by_leaf), n=1, cutoff=0.8)
    return by_leaf[close[0]] if close else None


def _has_key(data: Any, loc: tuple[int | str, ...]) -> bool:
    for part in loc:
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


def _where(loc: tuple[int | str, ...], overrides: dict[str, Any], yaml_path: Path | None) -> str:
    """Which source set `loc`: the --set items, the YAML file, else the environment."""
    if _has_key(overrides, loc):
        return "--set"
    if yaml_path is not None and _has_key(_YAML_DATA.get() or {}, loc):
        return str(yaml_path)
    return "the environment: AREAL_" + "__".join(str(p).upper() for p in loc)


def _literal_hint(err: Any) -> str:
    """`did you mean 'vllm'?` for a value close to one of a Literal's choices, else ""."""
    expected = re.findall(r"'([^']*)'", str(err.get("ctx", {}).get("expected", "")))
    got = err.get("input")
    if not isinstance(got, str) or not expected:
        return ""
    close = difflib.get_close_matches(got, expected, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else ""


def _format_errors(
    e: ValidationError, overrides: dict[str, Any] | None = None, yaml_path: Path | None = None
) -> str:
    """One line per error: the setting, what is wrong, the value, the fix. An unknown key gets
    "did you mean <the closest setting>" (never advice to set the typo) and names its source."""
    lines = []
    for err in e.errors():
        loc = tuple(err["loc"])
        name = ".".join(str(x) for x in loc) or "<config>"
        if err["type"] == "extra_forbidden":
            where = _where(loc, overrides or {}, yaml_path)
            guess = suggest_key(loc)
            if guess is not None:
                fix = f"did you mean {guess}?"
            else:
                section = _section_model(loc[:-1])
                known = ", ".join(section.model_fields) if section is not None else "none"
                fix = f"the settings here are: {known}"
            lines.append(f"config error: {name}: unknown setting (from {where}); {fix}")
            continue
        got = (
            f" (got {err['input']!r})"
            if "input" in err and not isinstance(err["input"], dict)
            else ""
        )
        if err["type"] in ("value_error", "assertion_error"):
            # our validators' own words, which name the setting and the fix: without
            # pydantic's "Value error, " and without the section (or "<config>") in front
            lines.append(f"config error: {_own_message(err)}")
            continue
        hint = _literal_hint(err) if err["type"] == "literal_error" else ""
        fix = (
            hint
            or (f"set it in the YAML or with --set {name}=..." if name != "<config>" else "")
            or "fix the config"
        )
        lines.append(f"config error: {name}: {err['msg']}{got}; {fix}")
    return "\n".join(lines)


def _own_message(err: Any) -> str:
    """The message a validator raised (`ValueError` / `assert`), without the prefix pydantic
    puts in front ("Value error, ", "Assertion failed, ")."""
    error = err.get("ctx", {}).get("error")
    if error is not None and str(error):
        return str(error)
    msg = str(err["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        msg = msg.removeprefix(prefix)
    return msg


def load_settings(
    path: str | os.PathLike | None = None, overrides: list[str] | None = None
) -> RunSettings:
    data: dict[str, Any] = {}
    p = Path(path) if path is not None else None
    if p is not None:
        if not p.is_file():
            raise ConfigError(f"config file {p} not found")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        if p.suffix == ".json":
            data.pop("resolved_at", None)
    override_data = parse_overrides(overrides or [])
    token = _YAML_DATA.set(data)
    try:
        return RunSettings(**override_data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, override_data, p)) from None
    finally:
        _YAML_DATA.reset(token)


def new_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()[:12]}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


class MonitorSettings(BaseSettings):
    """What `areal tap | top | metrics-exporter` read from the environment: they attach to a
    running run and have no YAML, so only the fields they need, each named as in `RunSettings`
    (`AREAL_RUN_ID`, `AREAL_NATS__URL`, `AREAL_LOG_LEVEL`, `AREAL_LOG_FORMAT`). Unrelated
    `AREAL_*` variables are ignored. Command-line flags win over these (the CLI applies them)."""

    model_config = SettingsConfigDict(env_prefix="AREAL_", extra="ignore", validate_by_name=True)

    run_id: str | None = Field(
        None, description="run to attach to; None = the only run on the server"
    )
    nats_url: str = Field(
        DEFAULT_NATS_URL,
        # NATS_URL is the nats ecosystem's standard variable (nats CLI, client libraries): an
        # alias here, below AREAL_NATS__URL, so `export NATS_URL=...` serves both tools.
        validation_alias=AliasChoices("AREAL_NATS__URL", "NATS_URL"),
        description="NATS server of the run (env AREAL_NATS__URL, else NATS_URL)",
    )
    credentials_file: str | None = Field(
        None,
        validation_alias=AliasChoices("AREAL_NATS__CREDENTIALS_FILE"),
        description="the monitor's NATS credentials (env AREAL_NATS__CREDENTIALS_FILE): a "
        "monitor.json of `areal nats-config`, a run dir of `areal run` (its "
        "keys/nats/monitor.json), or a NATS .creds file; None = none",
    )
    tls_ca_file: str | None = Field(
        None,
        validation_alias=AliasChoices("AREAL_NATS__TLS_CA_FILE"),
        description=NatsSettings.model_fields["tls_ca_file"].description,
    )
    tls_cert_file: str | None = Field(
        None,
        validation_alias=AliasChoices("AREAL_NATS__TLS_CERT_FILE"),
        description=NatsSettings.model_fields["tls_cert_file"].description,
    )
    tls_key_file: str | None = Field(
        None,
        validation_alias=AliasChoices("AREAL_NATS__TLS_KEY_FILE"),
        description=NatsSettings.model_fields["tls_key_file"].description,
    )
    log_level: LogLevelField = Field(
        "ERROR", description=LOG_LEVEL_HELP + "; ERROR here so that stdout stays data"
    )
    log_format: LogFormat = Field("console", description=LOG_FORMAT_HELP)


def load_monitor_settings() -> MonitorSettings:
    """`MonitorSettings` from the environment; a bad value raises `ConfigError` naming it."""
    try:
        return MonitorSettings()
    except ValidationError as e:
        raise ConfigError(
            "\n".join(
                f"config error: {_monitor_env_name(err['loc'])}: {_own_message(err)} "
                f"(got {err.get('input')!r}); fix or unset that environment variable"
                for err in e.errors()
            )
        ) from None


def _monitor_env_name(loc: tuple[int | str, ...]) -> str:
    name = str(loc[0]) if loc else ""
    return name.upper() if name.upper().startswith(("AREAL_", "NATS_")) else f"AREAL_{name.upper()}"
