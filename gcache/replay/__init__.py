"""Trace replayer: request traces through the real meta index, checkpoint and
eviction code, in process, with no KV bytes moved (``gcache replay``)."""
