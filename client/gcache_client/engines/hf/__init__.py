"""GCache for ``transformers`` causal LMs (MiMo-V2-Flash and other hybrid models).

Two calls an engine loop needs, plus a ``prefill`` that wires them together:

* :meth:`TransformersConnector.store` after a prefill: the prompt's KV from the
  model's ``DynamicCache`` into GCache (full layers for every block, sliding layers
  only for the trailing window: strict O(W));
* :meth:`TransformersConnector.load` before a prefill: the longest valid cached
  prefix as a cache object the model accepts. The cache fills itself *layer by
  layer*: the model's forward asks the cache for layer i (``update``) just before
  computing attention i, and only then waits for that layer's bytes, while the
  reads of the next ``layers_in_flight`` layers are already in flight on the
  client's I/O thread. So fetching layer i+1 overlaps computing layer i. The mask
  construction at the start of a forward needs layers 0 and the first sliding
  layer, so those two are waited for before any compute.
* :meth:`TransformersConnector.prefill`: look up, load, run the model on the
  remaining tokens in one forward, and store. The windows to store (the one
  ending at the last full block, and the checkpoint windows: the last interval
  multiple and the last block boundary before the end) are copied out of the
  sliding layers as the forward computes their rows (:class:`WindowCapture`), so
  any window and block size works (a window is stored rounded up to whole blocks,
  rows transformers itself drops), and the prefill is not split. Any load failure
  during the forward is a miss: the prefill is recomputed from scratch, never run
  on wrong KV; a store failure is logged and ignored.

The package: :mod:`.model` (layout, KV rows and identity of a model), :mod:`.cache`
(the cache objects a forward runs on) and :mod:`.connector` (``TransformersConnector``);
imports go that way only. torch and transformers are imported by this package only.
"""

from __future__ import annotations

from gcache_client.engines.hf.cache import GCachePrefixCache as GCachePrefixCache
from gcache_client.engines.hf.cache import PrefixLoadFailed as PrefixLoadFailed
from gcache_client.engines.hf.cache import WindowCapture as WindowCapture
from gcache_client.engines.hf.cache import set_layer_kv as set_layer_kv
from gcache_client.engines.hf.connector import PrefillOutput as PrefillOutput
from gcache_client.engines.hf.connector import TransformersConnector as TransformersConnector
from gcache_client.engines.hf.model import kv_from_cache as kv_from_cache
from gcache_client.engines.hf.model import layout_from_model as layout_from_model
from gcache_client.engines.hf.model import peft_identity as peft_identity
