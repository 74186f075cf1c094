"""Parts of the weights benchmark: synthetic Qwen2.5 state dicts, the physical bounds, and the
publisher and fetcher processes (each its own process, so its peak RSS is its own).

Invariants:
- the state dicts have the names and shapes of Qwen2.5 (tied embeddings, so no lm_head), with
  random values: nothing is downloaded;
- a process reports one JSON line on stdout (`RESULT <json>`) and, for fetchers, `READY`
  first, once subscribed; times are `time.time()` (one clock for every process of the host);
- a fetcher counts as done only when the weights it fetched verified (signature, size,
  SHA-256) and fit the model spec whole (names, shapes, dtypes, no NaN/inf).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import resource
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True)
class Arch:
    vocab: int
    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    qkv_bias: bool = True  # Qwen2 has q/k/v biases, Llama (SmolLM2) none


ARCHS = {
    "qwen2.5-0.5b": Arch(151936, 896, 4864, 24, 14, 2),
    "qwen2.5-1.5b": Arch(151936, 1536, 8960, 28, 12, 2),
    "quick-64m": Arch(8192, 512, 1536, 10, 8, 2),
    "smollm2-135m": Arch(49152, 576, 1536, 30, 9, 3, qkv_bias=False),
}


def shapes(arch: Arch) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a Qwen2 (or, without biases, Llama) state dict (tied embeddings)."""
    h, kv = arch.hidden, arch.hidden // arch.heads * arch.kv_heads
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (arch.vocab, h)}
    for i in range(arch.layers):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.q_proj.bias": (h,),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (arch.inter, h),
            p + "mlp.up_proj.weight": (arch.inter, h),
            p + "mlp.down_proj.weight": (h, arch.inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if not arch.qkv_bias:
            for x in "qkv":
                del out[p + f"self_attn.{x}_proj.bias"]
    out["model.norm.weight"] = (h,)
    return out


def n_params(arch: Arch) -> int:
    return sum(int(np.prod(s)) for s in shapes(arch).values())


def random_state(arch: Arch, dtype: str, seed: int = 0) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    dt = getattr(torch, dtype)
    return {
        k: torch.empty(s, dtype=dt).normal_(0.0, 0.02, generator=g) for k, s in shapes(arch).items()
    }


def rss_bytes() -> int:
    """Resident set size now (/proc/self/statm)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak RSS: VmHWM (getrusage's ru_maxrss survives exec, so a child would
    report its parent's peak), else ru_maxrss."""
    return vm_hwm_bytes(os.getpid()) or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def vm_hwm_bytes(pid: int) -> int:
    """Peak RSS of process `pid` (VmHWM), 0 when unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ------------------------------------------------------------------ physical bounds
def memcpy_gib_s(nbytes: int, reps: int = 3) -> float:
    """Best of `reps` numpy copies of an `nbytes` array into another (both pre-touched)."""
    src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / GIB / best


def sha256_mib_s(nbytes: int) -> float:
    data = np.ones(nbytes, dtype=np.uint8)
    t0 = time.perf_counter()
    hashlib.sha256(memoryview(data)).hexdigest()
    return nbytes / MIB / (time.perf_counter() - t0)


def loopback_tcp_gib_s(nbytes: int, piece: int = 4 * MIB) -> float:
    """`nbytes` through one TCP connection on 127.0.0.1 (a sender thread, this thread reads)."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def send() -> None:
        with socket.create_connection(("127.0.0.1", port)) as c:
            buf, left = memoryview(bytearray(piece)), nbytes
            while left:
                left -= c.send(buf[: min(piece, left)])

    sender = threading.Thread(target=send, daemon=True)
    conn, got = None, 0
    try:
        sender.start()
        conn, _ = srv.accept()
        buf = bytearray(piece)
        t0 = time.perf_counter()
        while got < nbytes:
            n = conn.recv_into(buf)
            if not n:
                break
            got += n
        dt = time.perf_counter() - t0
    finally:
        if conn is not None:
            conn.close()
        srv.close()
        sender.join(10)
    return got / GIB / dt


# ------------------------------------------------------------------ processes
@dataclass(frozen=True)
class Case:
    url: str
    run_id: str
    keys_dir: str
    weights_dir: str
    arch: str
    masters: str  # dtype the publisher holds
    wire: str  # dtype on the wire
    transport: str  # object_store | file
    timeout_s: float


def _emit(tag: str, payload: dict | None = None) -> None:
    sys.stdout.write(tag + ("" if payload is None else " " + json.dumps(payload)) + "\n")
    sys.stdout.flush()


async def _publish(case: Case) -> dict:
    from areal.bus.client import Bus
    from areal.engines.weights_stream import SafetensorsBlob
    from areal.security.keys import load_run_keys

    state = random_state(ARCHS[case.arch], case.masters)
    base_rss = rss_bytes()
    keys = load_run_keys(case.keys_dir, signing=True)
    bus = await Bus.connect(case.url, case.run_id, "trainer", "bench-trainer", keys=keys)
    try:
        blob = SafetensorsBlob(state, case.wire if case.wire != case.masters else None)
        file_dir = case.weights_dir if case.transport == "file" else None
        t0 = time.time()
        ann = await bus.put_weights(1, blob, case.wire, step=1, file_dir=file_dir)
        t1 = time.time()
    finally:
        await bus.close()
    return {
        "t0": t0,
        "t1": t1,
        "nbytes": ann.nbytes,
        "base_rss": base_rss,
        "state_bytes": sum(t.numel() * t.element_size() for t in state.values()),
        "peak_rss": peak_rss_bytes(),
    }


async def _fetch(case: Case) -> dict:
    from areal.bus.client import Bus
    from areal.engines.weights_check import TensorSpec, check_state_dict
    from areal.engines.weights_stream import SafetensorsSink
    from areal.security.keys import load_run_keys

    spec = {k: TensorSpec(s, "float32", True) for k, s in shapes(ARCHS[case.arch]).items()}
    keys = load_run_keys(case.keys_dir, signing=False)
    bus = await Bus.connect(
        case.url,
        case.run_id,
        "rollout",
        f"bench-rollout-{os.getpid()}",
        declare=False,
        keys=keys,
        weights_dir=case.weights_dir,
    )
    announced: asyncio.Queue = asyncio.Queue()

    async def on_ann(ann) -> None:
        announced.put_nowait((time.time(), ann))

    sub = await bus.subscribe_weights(on_ann)
    base_rss = rss_bytes()
    _emit("READY")
    try:
        t_ann, ann = await asyncio.wait_for(announced.get(), case.timeout_s)
        state = (await bus.fetch_weights(ann, SafetensorsSink)).state_dict()
        t_fetched = time.time()
        await asyncio.to_thread(check_state_dict, spec, state, what="bench weights")
        t_done = time.time()
    finally:
        await sub.unsubscribe()
        await bus.close()
    return {
        "t_ann": t_ann,
        "t_fetched": t_fetched,
        "t_done": t_done,
        "nbytes": ann.nbytes,
        "base_rss": base_rss,
        "peak_rss": peak_rss_bytes(),
    }


def role_main(role: str, case_json: str) -> int:
    import structlog
    import torch

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    torch.set_num_threads(1)
    case = Case(**json.loads(case_json))
    result = asyncio.run(_publish(case) if role == "publish" else _fetch(case))
    _emit("RESULT", result)
    return 0
