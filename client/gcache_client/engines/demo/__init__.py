"""The demo engine: :mod:`.engine` (the toy MiMo-V2-Flash model behind a GCache
prefix cache), :mod:`.server` (``gcache-engine``, its OpenAI-compatible HTTP
server) and :mod:`.chat` (the multi-turn chat demo of ``gcache demo``)."""
