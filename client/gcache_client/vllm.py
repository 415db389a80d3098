"""The stable vLLM config path (``kv_connector_module_path="gcache_client.vllm"``) of
:class:`gcache_client.engines.vllm.connector.GCacheConnector`."""

from gcache_client.engines.vllm.connector import GCacheConnector as GCacheConnector
