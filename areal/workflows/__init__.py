"""Rollout workflows: how one sample of a task becomes an episode (`api.py`)."""
