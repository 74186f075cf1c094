"""Pure RL math: staleness rule, GRPO advantages, decoupled-PPO loss, packing, a simulator.

Tensors and numbers in, tensors and numbers out: no asyncio, no nats, no schemas. Nothing is
re-exported here so that ``import areal.algo.staleness`` stays free of torch.
"""
