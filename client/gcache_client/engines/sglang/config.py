"""The backend's typed settings and their checks, from SGLang's
``--hicache-storage-backend-extra-config``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gcache.config import ClientConfig
from gcache.errors import ConfigError

__all__ = ["SGLANG_KEYS", "HiCacheGCacheConfig"]

# Keys SGLang itself reads from the extra config (or leaves in it): accepted, not ours.
SGLANG_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
        "tp_lcm_size",
    }
)
_CLIENT_FIELDS = {f.name: f for f in dataclasses.fields(ClientConfig)}


@dataclass(frozen=True)
class HiCacheGCacheConfig:
    """The backend's settings, from SGLang's ``--hicache-storage-backend-extra-config``
    (every ``ClientConfig`` field may be given too: ``meta``, ``meta_grpc``,
    ``transport``, ``timeout_s``, ``token_file``, ...). SGLang's own keys
    (:data:`SGLANG_KEYS`) are accepted and ignored; anything else is an error."""

    model_id: str = ""  # namespace model id; default: SGLang's model name
    revision: str = ""  # namespace revision (weights version)
    cache_salt: str = ""  # isolates tenants sharing one GCache
    max_batch_pages: int = 1024  # pages one call handles; past it they are misses
    max_pages_in_flight: int = 64  # page operations in flight at once (per backend)
    batch_timeout_s: float = 30.0  # a whole batch call; past it its pages are misses
    # TRAILING_PAGES pools: at most this many trailing pages stored per set, by pool
    # name ({"swa": 2}); pools not named store every page SGLang hands over.
    max_trailing_pages: tuple[tuple[str, int], ...] = ()
    max_tracked_pages: int = 1 << 20  # pages remembered for clear() (oldest forgotten)
    max_metric_samples: int = 1024  # get_stats() samples kept between two calls
    client: ClientConfig = field(default_factory=ClientConfig)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> HiCacheGCacheConfig:
        own = {f.name for f in dataclasses.fields(cls)} - {"client"}
        mine: dict[str, Any] = {}
        client: dict[str, Any] = {}
        for key, value in (extra or {}).items():
            if key in SGLANG_KEYS:
                continue
            if key in own:
                mine[key] = value
            elif key in _CLIENT_FIELDS:
                client[key] = value
            else:
                known = sorted(own | set(_CLIENT_FIELDS))
                raise ConfigError(
                    f"gcache sglang backend: unknown setting {key!r} (known: {', '.join(known)})"
                )
        trailing = mine.pop("max_trailing_pages", {})
        if not isinstance(trailing, Mapping) or not all(
            isinstance(k, str) and type(v) is int for k, v in trailing.items()
        ):
            raise ConfigError(
                "gcache sglang backend: max_trailing_pages must map pool names to page counts"
            )
        for name, value in mine.items():
            want = type(getattr(cls(), name))
            if want is float and type(value) is int:
                mine[name] = value = float(value)
            if type(value) is not want:
                raise ConfigError(
                    f"gcache sglang backend: {name} must be {want.__name__}, "
                    f"got {type(value).__name__}"
                )
        for name, value in client.items():
            want_c = type(_CLIENT_FIELDS[name].default)
            if want_c is float and type(value) is int:
                client[name] = float(value)
            elif type(value) is not want_c:
                raise ConfigError(
                    f"gcache sglang backend: {name} must be {want_c.__name__}, "
                    f"got {type(value).__name__}"
                )
        cfg = cls(
            **mine,
            max_trailing_pages=tuple(sorted(trailing.items())),
            client=dataclasses.replace(ClientConfig(), **client),
        )
        cfg.check()
        return cfg

    def check(self) -> None:
        for name in ("max_batch_pages", "max_pages_in_flight", "max_tracked_pages"):
            if getattr(self, name) < 1:
                raise ConfigError(
                    f"gcache sglang backend: {name} must be >= 1, got {getattr(self, name)}"
                )
        if self.max_metric_samples < 0:
            raise ConfigError("gcache sglang backend: max_metric_samples must be >= 0")
        if not self.batch_timeout_s > 0:
            raise ConfigError(
                f"gcache sglang backend: batch_timeout_s must be > 0, got {self.batch_timeout_s}"
            )
        for name, pages in self.max_trailing_pages:
            if pages < 1:
                raise ConfigError(
                    f"gcache sglang backend: max_trailing_pages[{name!r}] must be >= 1"
                )
        self.client.check()

    def trailing_cap(self, pool: str) -> int | None:
        return dict(self.max_trailing_pages).get(pool)
