"""Where the connector's threads run in a vLLM CPU worker.

vLLM's CPU worker binds its OpenMP threads one to a core (``GOMP_CPU_AFFINITY``,
``KMP_AFFINITY=...proclist=[...]`` or ``OMP_PLACES``, set in the worker's
environment by vLLM) and its main thread to the first of them; threads the
connector starts inherit that one-core mask. A GCache read (copy + xxh3
verification on the client's copy threads) on an OpenMP core preempts an OpenMP
thread, and every parallel region of the forward then waits for it.

:func:`client_cpus` picks the CPUs for the client's threads: the ones no OpenMP
thread is bound to (vLLM reserves a core for its scheduler process, and one more
when a KV connector is configured, where it has them), or none when OpenMP has
every core: then the worker reads a step's loads before the forward instead of
during it (:mod:`gcache_client.engines.vllm.worker`). Pure functions except
:func:`place`, which applies the mask to threads by their native id.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterable, Mapping

from gcache.errors import ConfigError

log = logging.getLogger("gcache.client.vllm")

THREAD_PREFIX = "gcache-"  # the client's threads: loop, copy, store, async loads


def parse_cpu_list(text: str) -> set[int]:
    """``"0,2-4 7"`` -> {0, 2, 3, 4, 7} (commas or blanks between items)."""
    out: set[int] = set()
    for item in re.split(r"[,\s]+", text.strip()):
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        try:
            a, b = int(lo), int(hi) if sep else int(lo)
        except ValueError as exc:
            raise ConfigError(f"not a CPU list: {text!r}") from exc
        if a < 0 or b < a:
            raise ConfigError(f"not a CPU list: {text!r}")
        out.update(range(a, b + 1))
    return out


def omp_cpus(env: Mapping[str, str]) -> set[int] | None:
    """The cores vLLM bound its OpenMP threads to, from the worker's environment;
    None when it did not say (no binding, or a form we do not read)."""
    try:
        if gomp := env.get("GOMP_CPU_AFFINITY"):
            return parse_cpu_list(gomp)
        kmp = re.search(r"proclist=\[([^\]]*)\]", env.get("KMP_AFFINITY", ""))
        if kmp:
            return parse_cpu_list(kmp.group(1))
        places = env.get("OMP_PLACES", "")
        if places.startswith("{") and places.endswith("}"):
            return parse_cpu_list(places[1:-1])
    except ConfigError:
        return None
    return None


def available_cpus() -> set[int]:
    """CPUs this process may use: the cgroup's cpuset when there is one, else every
    online CPU (the worker's own mask is already narrowed to its OpenMP core)."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/devices/system/cpu/online"):
        try:
            with open(path) as f:
                got = parse_cpu_list(f.read())
        except (OSError, ConfigError):
            continue
        if got:
            return got
    return set(range(os.cpu_count() or 1))


def client_cpus(setting: str, env: Mapping[str, str], available: set[int]) -> set[int] | None:
    """The CPUs for the client's threads, or None to leave them where they are.

    ``setting`` is the connector's ``client_cpus``: ``"auto"`` (the available CPUs
    no OpenMP thread is bound to; None when OpenMP has them all or vLLM bound
    nothing), ``"none"`` (leave them), or a CPU list (``"1,3-4"``)."""
    if setting == "none":
        return None
    if setting != "auto":
        return parse_cpu_list(setting)
    omp = omp_cpus(env)
    if omp is None:
        return None
    free = available - omp
    return free or None


def shares_omp_cores(cpus: set[int] | None, env: Mapping[str, str], available: set[int]) -> bool:
    """Whether the client's threads may run on a core an OpenMP thread is bound to
    (then a read during the forward stalls it)."""
    omp = omp_cpus(env)
    if omp is None:
        return False  # vLLM bound nothing: the OS spreads the threads
    return bool((cpus if cpus is not None else available) & omp)


class ThreadPlacer:
    """Binds the client's threads (named ``gcache-*``) to ``cpus``, each once;
    cheap to call every step (it looks only when the thread count changed)."""

    def __init__(self, cpus: set[int] | None) -> None:
        self.cpus = cpus
        self.placed: set[int] = set()
        self._seen = -1

    def place(self, threads: Iterable[threading.Thread] | None = None) -> int:
        """Bind threads not bound yet; returns how many were bound now."""
        if self.cpus is None:
            return 0
        if threads is None:
            n = threading.active_count()
            if n == self._seen:
                return 0
            self._seen = n
            threads = threading.enumerate()
        done = 0
        for t in threads:
            tid = t.native_id
            if tid is None or tid in self.placed or not t.name.startswith(THREAD_PREFIX):
                continue
            self.placed.add(tid)
            try:
                os.sched_setaffinity(tid, self.cpus)
            except OSError as exc:  # the thread just ended, or the CPUs are not ours
                log.warning("cannot bind %s to CPUs %s: %s", t.name, sorted(self.cpus), exc)
                continue
            done += 1
        return done
