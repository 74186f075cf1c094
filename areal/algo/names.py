"""The built-in names of `areal.algo.registry`, without importing torch (the settings check
them at load time; `test_registry` keeps both lists equal)."""

LOSS_NAMES = ("ppo", "gspo")
ADVANTAGE_NAMES = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
