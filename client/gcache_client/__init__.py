"""GCache client library: put, lookup, get and layerwise get_layers.

from gcache_client import GCacheClient
with GCacheClient(meta="127.0.0.1:7700", meta_grpc="127.0.0.1:7701") as c:
    ns = c.register_namespace("my-model", "mimo-v2-flash")
    c.put(ns, tokens, kv)                 # kv[l] = (K, V), [tokens, heads, dim]
    m = c.match(ns, tokens)               # leased longest valid prefix
    for layer in c.get_layers(m): ...     # layer by layer, reads in flight
    c.release(m)
"""

from gcache_client.aio import AsyncGCacheClient, LayerStream
from gcache_client.sync import GCacheClient, SyncLayerStream
from gcache_client.types import LayerKV, Match, Namespace, PutResult

__all__ = [
    "AsyncGCacheClient",
    "GCacheClient",
    "LayerKV",
    "LayerStream",
    "Match",
    "Namespace",
    "PutResult",
    "SyncLayerStream",
]
