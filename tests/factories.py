"""Small valid messages for tests; keyword arguments replace any field."""

from __future__ import annotations

import numpy as np

from areal.bus.codec import pack
from schemas import Sample, Task


def make_sample(n: int = 5, **fields) -> Sample:
    """A `Sample` of `n` generated tokens (task `run-t3`, index 1 of a group of 4)."""
    return Sample(
        **{
            "task_id": "run-t3",
            "task_seq": 3,
            "sample_idx": 1,
            "group_size": 4,
            "prompt_ids": pack([5, 6, 7], "int32"),
            "output_ids": pack(list(range(n)), "int32"),
            "behav_logp": pack(np.linspace(-2, -0.1, n), "float32"),
            "versions": pack([2] * n, "int32"),
            "output_text": "42",
            "answer": "42",
            "worker_id": "w",
            **fields,
        }
    )


def make_task(**fields) -> Task:
    """A `Task` (`t-good`, admitted at version 0, a group of 2); keyword arguments replace fields."""
    return Task(
        **{
            "task_id": "t-good",
            "seq": 0,
            "dataset_index": 0,
            "prompt": "1+1=",
            "prompt_ids": pack([5, 6, 7], "int32"),
            "answer": "2",
            "group_size": 2,
            "admitted_version": 0,
            **fields,
        }
    )


def process_alive(pid: int) -> bool:
    """`pid` exists and is not a zombie (read from /proc; Linux)."""
    from pathlib import Path

    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
