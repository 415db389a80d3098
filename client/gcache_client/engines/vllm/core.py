"""The GCache-facing core of the engine connectors (vLLM today, SGLang HiCache
later): no engine import here, only numpy and the client.

* :class:`BridgeConfig`: the connector's settings, parsed and checked from the
  engine's free-form extra config (``kv_connector_extra_config`` in vLLM).
* :class:`KVBridge`: one GCache client per engine process, namespaces per
  ``cache_salt`` (bounded), leased matches, a bounded queue of background stores
  (backpressure: a full queue makes the caller wait for the oldest store), and
  counters (:meth:`KVBridge.stats`).
* :class:`KVKey`: what besides the token ids makes a request's KV (cache salt,
  LoRA adapter, per-block multimodal / prompt-embedding hashes); every put and
  match of the bridge is keyed by it.
* :func:`match_to_wire` / :func:`match_from_wire`: a leased match as plain data,
  so the scheduler process can hand it to a worker process (vLLM pickles its
  connector metadata).

Storage rules the engine side follows (docs/engines.md): a prompt stores its
full blocks up to the last block boundary *before* its last token
(:meth:`KVBridge.store_tokens`), so the next identical prompt (which must leave
one token to compute) matches everything but its last block.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from gcache import layout as laymod
from gcache import wire
from gcache.config import ClientConfig
from gcache.errors import ConfigError, GCacheError, LayoutError
from gcache_client.engines.background import BackgroundStores
from gcache_client.engines.vllm.cpus import parse_cpu_list
from gcache_client.sync import GCacheClient
from gcache_client.types import KVPair, Match, Namespace, PutResult

log = logging.getLogger("gcache.client.engine_bridge")

_CLIENT_FIELDS = {f.name for f in dataclasses.fields(ClientConfig)}
LOAD_MODES = ("auto", "layerwise", "before", "async")


@dataclass(frozen=True)
class BridgeConfig:
    """Connector settings (``kv_connector_extra_config``). Every ``ClientConfig``
    field may be given too (``meta``, ``meta_grpc``, ``transport``, ``timeout_s``,
    ``load_or_recompute``, ...)."""

    model_id: str = ""  # namespace model id; default: the engine's model name
    revision: str = ""
    max_pending_stores: int = 4  # background stores in flight before a store waits
    max_namespaces: int = 64  # (cache_salt, adapter) namespaces kept registered per process
    # "layerwise": a hit loads during the request's first forward, layer by layer
    # (the forward waits per layer); "before": the step's loads are read whole
    # before its forward starts (nothing reads during the forward); "auto": layerwise
    # where the client's threads have a CPU of their own (see client_cpus), else
    # before; "async": a hit loads before the request is
    # scheduled (vLLM's WAITING_FOR_REMOTE_KVS) and a failed load is reported per
    # request, so vLLM recomputes it with any number of KV cache groups.
    load_mode: str = "auto"
    max_async_loads: int = 64  # async loads queued per worker before a step waits
    # CPUs for the client's threads in a vLLM CPU worker: "auto" = those vLLM bound
    # no OpenMP thread to, "none" = leave them, or a list ("1,3-4") (:mod:`.cpus`).
    client_cpus: str = "auto"
    store: bool = True  # False: this instance only loads (vLLM's kv_role kv_consumer)
    # KV events (with vLLM's --kv-events-config): report blocks GCache removed as
    # BlockRemoved(medium="GCACHE") (follows the meta's WatchRemovals stream), for
    # at most max_reported_blocks announced blocks (past it the oldest is retracted).
    report_removals: bool = True
    max_reported_blocks: int = 1 << 20
    # How a LoRA adapter is named in keys: "weights" = its name and a fingerprint
    # of its files (the scheduler reads the adapter directory; unreadable: the
    # request is neither loaded nor stored); "name" = its name and lora_int_id,
    # trusted to be unique within the model id and revision.
    lora_keys: str = "weights"
    client: ClientConfig = dataclasses.field(default_factory=ClientConfig)

    def check(self) -> None:
        if self.load_mode not in LOAD_MODES:
            raise ConfigError(f"load_mode must be one of {LOAD_MODES}, got {self.load_mode!r}")
        if self.lora_keys not in ("weights", "name"):
            raise ConfigError(f"lora_keys must be 'weights' or 'name', got {self.lora_keys!r}")
        if self.max_async_loads < 1:
            raise ConfigError(f"max_async_loads must be >= 1, got {self.max_async_loads}")
        if self.client_cpus not in ("auto", "none"):
            parse_cpu_list(self.client_cpus)
        if self.max_pending_stores < 1:
            raise ConfigError(f"max_pending_stores must be >= 1, got {self.max_pending_stores}")
        if self.max_namespaces < 1:
            raise ConfigError(f"max_namespaces must be >= 1, got {self.max_namespaces}")
        if self.max_reported_blocks < 1:
            raise ConfigError(f"max_reported_blocks must be >= 1, got {self.max_reported_blocks}")
        self.client.check()

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> BridgeConfig:
        cfg: BridgeConfig = settings_from_extra(cls, extra, "GCache connector")
        return cfg


def settings_from_extra(
    cls: type[Any],
    extra: Mapping[str, Any],
    what: str,
    client_defaults: Mapping[str, Any] | None = None,
) -> Any:
    """A connector's settings dataclass (with a ``client: ClientConfig`` field and
    a ``check()``) from an engine's free-form extra config: its own fields and any
    ``ClientConfig`` field; an unknown key or a wrong type is one ConfigError."""
    own = {f.name for f in dataclasses.fields(cls)} - {"client"}
    unknown = set(extra) - own - _CLIENT_FIELDS
    if unknown:
        raise ConfigError(f"unknown {what} settings: {sorted(unknown)}")
    client_kw = dict(client_defaults or {})
    client_kw.update({k: v for k, v in extra.items() if k in _CLIENT_FIELDS})
    try:
        cfg = cls(client=ClientConfig(**client_kw), **{k: v for k, v in extra.items() if k in own})
    except TypeError as exc:
        raise ConfigError(f"{what} settings: {exc}") from exc
    cfg.check()
    return cfg


@dataclass(frozen=True)
class KVKey:
    """What besides the token ids makes a request's KV, as the bridge keys it.

    * ``salt``: the request's ``cache_salt`` (the tenant's namespace prefix);
    * ``identity``: what changes the KV of *every* block (the LoRA adapter's name
      and a fingerprint of its weights, the pipeline stage), canonical text;
      ``salt`` and ``identity`` choose the namespace;
    * ``extras``: one byte string per full block, mixed into that block's key
      (multimodal content hashes with their offsets, prompt-embedding hashes), or
      None when no block has any;
    * ``lora_name`` / ``event_keys``: the same identity as vLLM's KV events carry
      it (the adapter's name, the per-block extra keys), for the events this
      connector publishes.
    """

    salt: str = ""
    identity: str = ""
    extras: tuple[bytes, ...] | None = None
    lora_name: str | None = None
    event_keys: tuple[Any, ...] | None = None

    @property
    def namespace_key(self) -> tuple[str, str]:
        return (self.salt, self.identity)

    def extras_for(self, nblocks: int) -> list[bytes] | None:
        """Extras of the first ``nblocks`` blocks (None when there are none)."""
        if self.extras is None:
            return None
        if len(self.extras) < nblocks:
            raise LayoutError(f"{len(self.extras)} block extras for {nblocks} blocks")
        return list(self.extras[:nblocks])


PLAIN = KVKey()


MatchWire = tuple[int, int, int, Any, Any, bytes]


def match_to_wire(m: Match) -> MatchWire:
    return (
        m.blocks,
        m.tokens,
        m.lease_id,
        msgspec.to_builtins(list(m.objects.values())),
        msgspec.to_builtins(m.servers),
        m.namespace.fingerprint,
    )


def wire_namespace(data: MatchWire) -> bytes:
    """The fingerprint of the namespace a wired match was made in."""
    return data[5]


def match_from_wire(ns: Namespace, data: MatchWire) -> Match:
    """The match back, in ``ns`` (the caller checks :func:`wire_namespace` first:
    objects of another namespace are another shard's)."""
    blocks, tokens, lease, objects, servers, _fp = data
    return Match(
        ns,
        blocks,
        tokens,
        lease,
        msgspec.convert(objects, list[wire.ObjectLoc]),
        msgspec.convert(servers, list[wire.ServerAddr]),
    )


def store_tokens(prompt_len: int, block_size: int) -> int:
    """Tokens of a prompt that are stored: its full blocks up to the last block
    boundary before its last token (an identical prompt later matches all of them)."""
    return max(0, (prompt_len - 1) // block_size) * block_size


class KVBridge:
    """GCache for one engine process (thread-safe for the calls an engine makes)."""

    def __init__(
        self,
        config: BridgeConfig,
        model_id: str,
        spec: laymod.LayoutSpec,
        *,
        tp_size: int = 1,
        tp_rank: int = 0,
        stage: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config.check()
        self.config = config
        self.model_id = config.model_id or model_id
        self.spec = spec
        self.layout = laymod.Layout(spec)
        self.tp_size, self.tp_rank = tp_size, tp_rank
        # The pipeline stage ("pp=RANK/SIZE"; "" without pipeline parallelism): two
        # stages with equal layer shapes hold different layers' KV.
        self.stage = stage
        self._clock = clock
        self.client = GCacheClient(config.client)
        self._ns: OrderedDict[tuple[str, str], Namespace] = OrderedDict()
        self._lock = threading.Lock()
        self._stores: BackgroundStores[PutResult | None] = BackgroundStores(
            self.config.max_pending_stores, "gcache-store"
        )
        self.counters: Counter[str] = Counter()

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    def namespace(self, key: KVKey = PLAIN) -> Namespace:
        """The namespace of ``key``'s salt and identity (registered once, the most
        recent ``max_namespaces`` kept)."""
        nk = key.namespace_key
        with self._lock:
            ns = self._ns.get(nk)
            if ns is not None:
                self._ns.move_to_end(nk)
                return ns
        identity = key.identity
        if self.stage:
            identity = f"{identity}\x1f{self.stage}" if identity else self.stage
        ns = self.client.register_namespace(
            self.model_id,
            self.spec,
            block_size=self.spec.block_size,
            revision=self.config.revision,
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            cache_salt=key.salt,
            kv_identity=identity,
        )
        with self._lock:
            self._ns[nk] = ns
            while len(self._ns) > self.config.max_namespaces:
                self._ns.popitem(last=False)
        return ns

    def namespaces(self) -> list[Namespace]:
        """The namespaces registered so far (most recently used last)."""
        with self._lock:
            return list(self._ns.values())

    # ---- scheduler side ------------------------------------------------------------

    def match(self, tokens: Sequence[int] | np.ndarray, key: KVKey = PLAIN) -> Match:
        """Longest window-safe prefix of ``tokens`` with a read lease (a miss on any
        store problem)."""
        try:
            ns = self.namespace(key)
            extras = key.extras_for(len(tokens) // self.block_size)
        except GCacheError as exc:
            log.warning("namespace registration failed (miss): %s", exc)
            self.counters["lookup_errors"] += 1
            return Match(_NO_NS, 0, 0)
        t0 = self._clock()
        m = self.client.match(ns, np.asarray(tokens, dtype=np.int64), extras=extras)
        self.counters["lookups"] += 1
        self.counters["lookup_us"] += int((self._clock() - t0) * 1e6)
        self.counters["hit_tokens"] += m.tokens
        return m

    def release(self, m: Match) -> None:
        if m.lease_id:
            try:
                self.client.release(m)
            except GCacheError as exc:  # a lost release only means the lease runs out
                log.warning("release failed: %s", exc)

    # ---- worker side ---------------------------------------------------------------

    def store_async(
        self,
        tokens: np.ndarray,
        kv: list[KVPair],
        key: KVKey,
        done: Callable[[PutResult | None], None] | None = None,
    ) -> None:
        """Store ``tokens``' KV in the background. ``kv`` must stay untouched until
        the store is done (the put writes straight from it). At most
        ``max_pending_stores`` run at once: past that, this call waits for the oldest."""
        fut, waited = self._stores.submit(self._store, tokens, kv, key)
        if waited:
            self.counters["store_waits"] += 1
        if done is not None:
            fut.add_done_callback(lambda f: done(f.result()))

    def _store(self, tokens: np.ndarray, kv: list[KVPair], key: KVKey) -> PutResult | None:
        t0 = self._clock()
        try:
            extras = key.extras_for(len(tokens) // self.block_size)
            res = self.client.put(self.namespace(key), tokens, kv, extras=extras)
        except GCacheError as exc:  # a store problem never fails a request
            log.warning("store of %d tokens failed: %s", len(tokens), exc)
            self.counters["store_errors"] += 1
            return None
        self.counters["stores"] += 1
        self.counters["store_us"] += int((self._clock() - t0) * 1e6)
        self.counters["objects_stored"] += res.stored
        self.counters["objects_deduped"] += res.deduped
        self.counters["bytes_stored"] += res.bytes_written
        if not res.ok:
            self.counters["store_errors"] += 1
        return res

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every background store."""
        self._stores.flush(timeout)

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        out.update({f"client_{k}": v for k, v in self.client.stats().items()})
        out["pending_stores"] = self._stores.in_flight()
        return out

    def close(self) -> None:
        try:
            self.flush(self.config.client.timeout_s * 4)
        finally:
            self._stores.shutdown()
            self.client.close()


_NO_NS = Namespace(b"\0" * 16, "", laymod.Layout(laymod.preset("llama-3-8b", 16)))
