"""The stable SGLang config path (``"module_path": "gcache_client.sglang"``) of
:class:`gcache_client.engines.sglang.GCacheHiCacheStorage`."""

from gcache_client.engines.sglang import GCacheHiCacheStorage as GCacheHiCacheStorage
