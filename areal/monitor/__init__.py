"""Observability: tap (decode any subject live), top (live dashboard), a Prometheus exporter,
TensorBoard / W&B writers and plots from `metrics.jsonl`.

Everything here only observes: it goes through `areal.bus.tap` (never `nats` directly), and a
tap on a work-queue stream is a core subscription that neither consumes nor delays anything.
"""
