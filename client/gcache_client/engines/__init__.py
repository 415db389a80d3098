"""Engine integrations on top of the store client (:mod:`gcache_client`).

* :mod:`.vllm` - the vLLM KV connector (and :mod:`.vllm.ec`, the encoder-cache connector);
* :mod:`.sglang` - the SGLang HiCache storage backend;
* :mod:`.hf` - transformers (``TransformersConnector``, ``GCachePrefixCache``);
* :mod:`.demo` - the demo engine, its OpenAI-compatible server (``gcache-engine``)
  and the chat demo;
* :mod:`.local_cache` - an engine's own prefix cache (hashes, LRU, sliding windows);
* :mod:`.kv_events` - KV events: what an engine publishes and what the router consumes.

The store client never imports this package (an import-linter contract says so).
Imports here name their module (nothing is re-exported): each engine pulls in
only its own third-party library.
"""
