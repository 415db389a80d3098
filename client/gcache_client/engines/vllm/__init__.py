"""The vLLM KV connector on GCache (vLLM's KV connector API v1).

Configs name the stable path ``kv_connector_module_path="gcache_client.vllm"``
(a re-export of :class:`.connector.GCacheConnector`). The parts, imports going
down this list only (an import-linter contract):

* :mod:`.connector` - ``GCacheConnector``, vLLM's entry point; composes the two sides;
* :mod:`.scheduler` - the scheduler side (leased matches, load and store plans);
* :mod:`.worker` - the worker side (layerwise loads and stores into vLLM's paged cache);
* :mod:`.events` - KV events of the scheduler side (blocks GCache stored and evicted);
* :mod:`.keys` - per-request keys (cache salt, LoRA, multimodal items, prompt embeddings);
* :mod:`.meta` - the metadata the scheduler hands the workers, the layer map;
* :mod:`.async_loader` - background loads of ``load_mode="async"``;
* :mod:`.paged` - rows to and from vLLM's CPU paged KV cache;
* :mod:`.core` - the engine-agnostic GCache part (settings, namespaces, the bridge);
* :mod:`.cpus` - where the connector's threads run in a CPU worker;
* :mod:`.ec` - the encoder-cache connector (``ec_connector_module_path="gcache_client.vllm_ec"``).

Nothing is imported here: the engine-agnostic parts (:mod:`.core`, :mod:`.keys`,
:mod:`.cpus`, :mod:`.paged`) load without vLLM.
"""
