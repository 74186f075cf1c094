"""Pure cores: each role's decisions as a synchronous state machine over typed state.

No asyncio, no nats, no torch: services feed these cores events (a message arrived, a step was
trained, weights arrived) and perform the actions they return (publish, ack, load weights). The
simulator (`tests/sim.py`, with the tests' helpers: only tests use it) drives the very same
cores, so the property test checks the code that runs.
"""
