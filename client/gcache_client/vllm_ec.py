"""The stable vLLM config path (``ec_connector_module_path="gcache_client.vllm_ec"``) of
:class:`gcache_client.engines.vllm.ec.connector.GCacheECConnector`."""

from gcache_client.engines.vllm.ec.connector import (
    GCacheECConnector as GCacheECConnector,
)
