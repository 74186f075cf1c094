"""Inference and training engines behind the Protocols of `areal.engines.base`.

Import the concrete engines from their modules (or build them with `areal.engines.factory`);
this package import stays light.
"""
