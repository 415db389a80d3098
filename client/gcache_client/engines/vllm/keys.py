"""What, besides the token ids, makes a vLLM request's KV: the :class:`KVKey` the
connector puts and matches it under.

vLLM's own prefix cache hashes every block with *extra keys*
(``vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys``): the LoRA
adapter, the multimodal items in the block (content hash and offset), the
``cache_salt`` (first block) and a hash of the block's prompt embeddings. The
connector keys GCache blocks by the same things, so a block is only ever read by
a request whose KV it is:

* the ``cache_salt`` and the LoRA adapter choose the namespace. The adapter is
  named by its name *and* a fingerprint of its files (xxh3-128 over the
  adapter directory's files: ``adapter_config.json`` and the weights), so two
  deployments' ``adapter-1`` with other weights never share blocks, and one
  adapter mounted at two paths does. With ``lora_keys: "name"`` the name and
  vLLM's ``lora_int_id`` are trusted instead (for adapters vLLM resolves from a
  place the scheduler cannot read; the operator promises names are unique within
  the model id and revision);
* the other extra keys of each GCache block (vLLM's, computed over the GCache
  block's token range, which spans one or more vLLM blocks) are mixed into that
  block's key (:func:`gcache.keys.block_keys` ``extras``);
* the tokens keyed are vLLM's own (``all_token_ids`` of the prompt: zeros where a
  prompt gives embeddings instead of tokens, as in vLLM's block hashes).

A request whose KV cannot be keyed safely (an adapter whose files cannot be read,
a multimodal item without a content hash, an extra key that cannot be encoded)
is neither loaded nor stored (``unkeyable_requests``); never guessed.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from gcache.errors import ConfigError
from gcache_client.engines.vllm.core import PLAIN, KVKey

log = logging.getLogger("gcache.client.vllm")

LORA_KEYS = ("weights", "name")
MAX_ADAPTER_FILES = 256  # files hashed per adapter directory (more: unkeyable)
_HASH_CHUNK = 8 << 20


class Unkeyable(Exception):
    """This request's KV cannot be keyed safely: neither load nor store it."""


class AdapterFingerprints:
    """Fingerprints of LoRA adapter directories, computed once per (path, file
    sizes and modification times) and kept for the ``capacity`` most recent."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._fps: OrderedDict[tuple[Any, ...], str] = OrderedDict()
        self._lock = threading.Lock()
        self.computed = 0

    def __call__(self, path: str) -> str:
        root = Path(path)
        if not root.is_dir():
            raise Unkeyable(f"LoRA adapter path {path!r} is not a directory the scheduler can read")
        try:
            files = sorted(p for p in root.rglob("*") if p.is_file())
            if len(files) > MAX_ADAPTER_FILES:
                raise Unkeyable(f"LoRA adapter {path!r} has more than {MAX_ADAPTER_FILES} files")
            stat = tuple(
                (str(p.relative_to(root)), st.st_size, st.st_mtime_ns)
                for p in files
                for st in (p.stat(),)
            )
        except OSError as exc:
            raise Unkeyable(f"LoRA adapter {path!r}: {exc}") from exc
        key = (str(root.resolve()), stat)
        with self._lock:
            fp = self._fps.get(key)
            if fp is not None:
                self._fps.move_to_end(key)
                return fp
        h = xxhash.xxh3_128()
        try:
            for (rel, size, _), p in zip(stat, files, strict=True):
                h.update(f"{rel}\0{size}\0".encode())
                with open(p, "rb") as fh:
                    while chunk := fh.read(_HASH_CHUNK):
                        h.update(chunk)
        except OSError as exc:
            raise Unkeyable(f"LoRA adapter {path!r}: {exc}") from exc
        fp = h.hexdigest()
        with self._lock:
            self.computed += 1
            self._fps[key] = fp
            while len(self._fps) > self.capacity:
                self._fps.popitem(last=False)
        return fp


def _extra_keys_fn() -> Callable[..., tuple[tuple[Any, ...] | None, int]]:
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    return generate_block_hash_extra_keys  # type: ignore[no-any-return]


class RequestKeys:
    """Makes the :class:`KVKey` and the keyed tokens of vLLM requests (scheduler
    side; the worker gets both in the step metadata)."""

    def __init__(
        self,
        block_size: int,
        lora_keys: str = "weights",
        fingerprints: AdapterFingerprints | None = None,
    ) -> None:
        if lora_keys not in LORA_KEYS:
            raise ConfigError(f"lora_keys must be one of {LORA_KEYS}, got {lora_keys!r}")
        self.block_size = block_size
        self.lora_keys = lora_keys
        self.fingerprints = fingerprints or AdapterFingerprints()
        self.counters: Counter[str] = Counter()
        self._extra_keys = _extra_keys_fn()

    def tokens(self, request: Any) -> list[int]:
        """The prompt's token ids as vLLM hashes them (zeros where the prompt gave
        embeddings)."""
        n = int(request.num_prompt_tokens)
        if getattr(request, "prompt_embeds", None) is None and request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        return [int(t) for t in request.all_token_ids[:n]]

    def key(self, request: Any) -> KVKey:
        """The request's key; raises :class:`Unkeyable` (counted) when it has none."""
        try:
            return self._key(request)
        except Unkeyable as exc:
            self.counters["unkeyable_requests"] += 1
            log.warning(
                "GCache: request %s is neither loaded nor stored: %s",
                getattr(request, "request_id", "?"),
                exc,
            )
            raise

    def _key(self, request: Any) -> KVKey:
        salt = getattr(request, "cache_salt", None) or ""
        lora = getattr(request, "lora_request", None)
        embeds = getattr(request, "prompt_embeds", None) is not None
        mm = bool(getattr(request, "mm_features", None))
        if lora is None and not embeds and not mm:
            if not salt:
                return PLAIN
            self.counters["salted_requests"] += 1
            return self._block_extras(request, salt, "", None)
        identity, lora_name = "", None
        if lora is not None:
            lora_name = str(lora.lora_name)
            if self.lora_keys == "weights":
                fp = self.fingerprints(str(lora.lora_path))
                identity = f"lora={lora_name}@{fp}"
            else:
                identity = f"lora={lora_name}#{int(lora.lora_int_id)}"
            self.counters["lora_requests"] += 1
        if not embeds and not mm:
            return self._block_extras(request, salt, identity, lora_name)
        if mm:
            for f in request.mm_features:
                if not getattr(f, "identifier", None):
                    raise Unkeyable("a multimodal item has no content hash")
            self.counters["mm_requests"] += 1
        if embeds:
            self.counters["prompt_embeds_requests"] += 1
        return self._block_extras(request, salt, identity, lora_name)

    def _block_extras(self, request: Any, salt: str, identity: str, lora_name: str | None) -> KVKey:
        bs = self.block_size
        nblocks = int(request.num_prompt_tokens) // bs
        extras: list[bytes] = []
        events: list[Any] = []
        mm_idx = 0
        for i in range(nblocks):
            try:
                keys, mm_idx = self._extra_keys(request, i * bs, (i + 1) * bs, mm_idx)
            except (AssertionError, AttributeError, IndexError, TypeError, ValueError) as exc:
                raise Unkeyable(f"vLLM's extra keys of block {i}: {exc!r}") from exc
            # The adapter and the salt are in the namespace already (the adapter by
            # its weights, not its path); the rest is this block's own.
            own = tuple(k for k in keys or () if k[0] not in ("lora", "cache_salt"))
            try:
                extras.append(msgspec.msgpack.encode(own) if own else b"")
            except (TypeError, msgspec.EncodeError) as exc:
                raise Unkeyable(f"extra key of block {i} cannot be encoded: {exc}") from exc
            events.append(_event_keys(keys))
        return KVKey(
            salt=salt,
            identity=identity,
            # Only the salt or the adapter (namespace): no block has extras of its own.
            extras=tuple(extras) if any(extras) else None,
            lora_name=lora_name,
            event_keys=tuple(events),
        )

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        out["adapter_fingerprints"] = self.fingerprints.computed
        return out


def _event_keys(keys: tuple[Any, ...] | None) -> tuple[Any, ...] | None:
    """One block's extra keys as vLLM's KV events publish them (untagged: bare
    LoRA names and salts, ``(mm_hash, offset)`` pairs, bare embedding digests)."""
    if not keys:
        return None
    return tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)
