"""Sluice runtime: a KServe V2 / Open Inference Protocol server for Triton-style model repositories.

Layers, one direction: ``server`` -> ``protocol`` (HTTP, gRPC) -> ``dataplane`` -> ``batching`` /
``repository`` -> ``backends`` -> ``types`` / ``errors`` / ``settings``.
"""

__version__ = "0.1.0"
