"""``gcache-router``: the KV-affinity router sidecar.

Layers, imports one way: :mod:`.policy` (interfaces and value types, no I/O) <-
:mod:`.index` / :mod:`.scoring` / :mod:`.baselines` (plain synchronous decision
logic with an injected clock) <- :mod:`.events` (vLLM KV-event decoding) <- the
daemon (asyncio, HTTP, ZMQ) and the simulator (:mod:`gcache.replay`).
"""
