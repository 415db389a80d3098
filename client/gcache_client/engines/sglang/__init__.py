"""SGLang HiCache storage backend on GCache (sglang 0.5.x, tested with 0.5.23).

Loaded by SGLang's dynamic backend factory, with no change to SGLang::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "gcache",
        "module_path": "gcache_client.sglang", "class_name": "GCacheHiCacheStorage",
        "interface_v1": 1, "meta": "10.0.0.5:7700", "meta_grpc": "10.0.0.5:7701"}'

Keys. SGLang hands one hash string per page, already chained over the prefix
(``get_hash_str``), so a page hash names the whole prefix up to that page. Each
page is one GCache block of its own, keyed with the public client API: a
one-token "prompt" (token 0, ``block_size`` 1) whose per-block extra is the page
hash, i.e. ``xxh3_128(namespace fingerprint || int32 0 || hash)``
(:func:`gcache.keys.block_keys`). The namespace fingerprint carries the model,
the TP rank and size, the host pool's layout and dtype, the pool (KV, SWA,
Mamba, ...), the pipeline stage and the page geometry, so two models, ranks or
layouts never share a key. The pages are independent roots of the meta's index
(not a chain): SGLang calls with any run of a sequence's pages (a batch of 128,
a radix node's pages), never necessarily from its first page, and a GCache chain
would fix each page's position at its first put. Prefix semantics stay SGLang's:
``batch_exists`` counts the leading pages present.

Bytes. The host pool describes where a page lies with ``get_page_buffer_meta``
(SGLang's zero-copy v1 interface): a fixed list of regions per page (K and V of
every layer for ``layer_first``, one K and one V region for ``page_first``,
``page_first_direct`` and ``page_head``, one region per page or layer for MLA).
Each region is one layer of the GCache layout (its first half as "K", its second
as "V", a byte container: the client checksums each layer with xxh3-64 on put
and verifies it on every read). Puts copy straight out of the host pages and
reads land straight in them (numpy views over the pool's memory, no staging).
The non-zero-copy ``get``/``set``/``batch_get``/``batch_set`` (SGLang's flat
data pages) use a namespace of their own ("flat" format), so the two formats
never mix.

Parallelism. Every TP rank reads and writes its own shard's namespace. With MLA
(``is_mla_model``, KV replicated across ranks) the KV namespace is shared by
every rank; only the storage writer (rank 0) stores, the others' sets are
skipped (reported done), all read the one copy. Mamba state stays per rank.

Sliding window (v2, ``PoolHitPolicy.TRAILING_PAGES``): a hybrid model's SWA or
Mamba pool stores only the trailing pages SGLang hands it, capped per pool by
``max_trailing_pages`` (GCache's strict O(W): the window a match ending there
needs), and ``batch_exists_v2`` reports the prefix lengths whose trailing
window is complete on every pool.

Failures are misses: a store that is down, slow or returns bytes failing their
checksum makes pages missing (``False``/``None``/0), never an exception into
SGLang; misuse (a layout the backend cannot describe, an unknown setting) is a
:class:`~gcache.errors.ConfigError` when the backend is built or the pool is
registered.

The package: :mod:`.config` (the typed settings and their checks), :mod:`.pages`
(page geometry and the views between the host pool and GCache),
:mod:`.namespaces` (pools, namespaces, page keys), :mod:`.metrics` (counters and
samples), :mod:`.ops` (the page operations on the client's loop) and
:mod:`.backend` (the ``HiCacheStorage`` composing them); imports go that way only.
"""

from __future__ import annotations

from gcache_client.engines.sglang.backend import GCacheHiCacheStorage
from gcache_client.engines.sglang.config import SGLANG_KEYS as SGLANG_KEYS
from gcache_client.engines.sglang.config import HiCacheGCacheConfig
from gcache_client.engines.sglang.pages import SUPPORTED_LAYOUTS as SUPPORTED_LAYOUTS
from gcache_client.engines.sglang.pages import layout_for_regions as layout_for_regions

__all__ = ["GCacheHiCacheStorage", "HiCacheGCacheConfig"]

# SGLang's dynamic loader names the class by its stable config path (module_path,
# the re-export :mod:`gcache_client.sglang`); say so.
CONFIG_PATH = "gcache_client.sglang"
GCacheHiCacheStorage.__module__ = CONFIG_PATH
HiCacheGCacheConfig.__module__ = CONFIG_PATH
