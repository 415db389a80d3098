"""vLLM's encoder cache on GCache: :mod:`.connector` (``GCacheECConnector``, vLLM's
entry point; configs name ``ec_connector_module_path="gcache_client.vllm_ec"``)
over :mod:`.store` (the engine-agnostic encoder-output store, keyed by content hash)."""
