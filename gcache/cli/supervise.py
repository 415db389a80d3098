"""``gcache up``'s supervisor: which dead process to start again, and when.

Plain synchronous bookkeeping with the clock passed in (``now``, monotonic
seconds); the ``gcache up`` loop (:func:`gcache.cli.main.cmd_up`) drives it: it
reports what it sees (:meth:`Supervisor.exited`, :meth:`Supervisor.ready`), asks
what to start (:meth:`Supervisor.due`) and which start takes too long
(:meth:`Supervisor.overdue`), and does the process work itself. A process is
named (``meta``, ``meta1``, ``etcd``, ``server0``, ...); the supervisor knows
nothing else about it.

Each name is in one state:

* ``starting``: spawned, not ready yet (at most one instance: :meth:`due` hands a
  name out once, and only a name that is backing off);
* ``running``: ready;
* ``backing-off``: dead, to be started again at ``next_at``;
* ``given-up``: it died :attr:`Policy.max_restarts` times within
  :attr:`Policy.window_s`; never started again.

Back-off: the first restart after a process that ran for
:attr:`Policy.reset_after_s` or more waits :attr:`Policy.initial_backoff_s`;
each quicker death doubles the wait, up to :attr:`Policy.max_backoff_s`.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gcache.cli.deploy import signal_group
from gcache.errors import ConfigError, GCacheError

if TYPE_CHECKING:
    from gcache.cli.deploy import LocalDeployment

STARTING = "starting"
RUNNING = "running"
BACKING_OFF = "backing-off"
GIVEN_UP = "given-up"


@dataclass(frozen=True, slots=True)
class Policy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    # A process that stayed up this long starts its next back-off from the beginning.
    reset_after_s: float = 30.0
    # More than this many restarts within window_s: give up on the process.
    max_restarts: int = 5
    window_s: float = 60.0
    # A restarted process not ready within this long is killed (and counts as a death).
    start_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_backoff_s <= self.max_backoff_s:
            raise ConfigError(
                f"restart back-off must be > 0 and at most its maximum, got "
                f"{self.initial_backoff_s:g} and {self.max_backoff_s:g}"
            )
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.window_s <= 0 or self.start_timeout_s <= 0 or self.reset_after_s < 0:
            raise ConfigError("the restart window and start timeout must be > 0")


@dataclass(slots=True)
class ProcState:
    name: str
    state: str = STARTING
    restarts: int = 0  # restarts done since gcache up started it
    last_exit: int | None = None  # exit code of the last death (negative: signal)
    backoff_s: float = 0.0  # the wait before the pending (or last) restart
    next_at: float = 0.0  # when a backing-off process is due
    since: float = 0.0  # when it entered its current state
    recent: deque[float] = field(default_factory=deque)  # restart times in the window


@dataclass(frozen=True, slots=True)
class Decision:
    """What :meth:`Supervisor.exited` decided, and the one line that says so."""

    name: str
    state: str  # BACKING_OFF or GIVEN_UP
    delay_s: float
    line: str


class Supervisor:
    def __init__(self, names: list[str], now: float, policy: Policy | None = None) -> None:
        """``names``: the processes, all being started at ``now``."""
        self.policy = policy or Policy()
        self.procs: dict[str, ProcState] = {}
        for name in names:
            self.add(name, now)

    def add(self, name: str, now: float) -> None:
        """A process started outside :meth:`due` (the deployment's first start)."""
        if name in self.procs:
            raise ValueError(f"{name} is supervised already")
        self.procs[name] = ProcState(name, STARTING, since=now)

    def state(self, name: str) -> str:
        return self.procs[name].state

    def ready(self, name: str, now: float) -> None:
        p = self.procs[name]
        if p.state == STARTING:
            p.state, p.since = RUNNING, now

    def exited(self, name: str, code: int | None, now: float) -> Decision:
        """A running or starting process died with ``code`` (None: it could not
        even be spawned): back off, or give up."""
        p = self.procs[name]
        if p.state not in (STARTING, RUNNING):
            raise ValueError(f"{name} is {p.state}, not alive")
        pol = self.policy
        stayed_up = p.state == RUNNING and now - p.since >= pol.reset_after_s
        if stayed_up or p.backoff_s == 0:
            p.backoff_s = pol.initial_backoff_s
        else:
            p.backoff_s = min(p.backoff_s * 2, pol.max_backoff_s)
        p.last_exit = code
        while p.recent and p.recent[0] <= now - pol.window_s:
            p.recent.popleft()
        how = "could not be started" if code is None else f"exited ({code})"
        if len(p.recent) >= pol.max_restarts:
            p.state, p.since = GIVEN_UP, now
            return Decision(
                name,
                GIVEN_UP,
                0.0,
                f"{name} {how}; restarted {len(p.recent)} times in {pol.window_s:g} s "
                "already, giving up on it",
            )
        p.state, p.since, p.next_at = BACKING_OFF, now, now + p.backoff_s
        return Decision(
            name,
            BACKING_OFF,
            p.backoff_s,
            f"{name} {how}; restarting it in {p.backoff_s:g} s (restart {p.restarts + 1})",
        )

    def due(self, now: float) -> list[str]:
        """Names to start again now; each moves to ``starting`` (so a second call
        does not hand it out again)."""
        out = []
        for p in self.procs.values():
            if p.state == BACKING_OFF and p.next_at <= now:
                p.state, p.since = STARTING, now
                p.restarts += 1
                p.recent.append(now)
                out.append(p.name)
        return out

    def next_due(self) -> float | None:
        """When the earliest backing-off process is due (None: none is)."""
        times = [p.next_at for p in self.procs.values() if p.state == BACKING_OFF]
        return min(times) if times else None

    def overdue(self, now: float) -> list[str]:
        """Starting processes not ready within :attr:`Policy.start_timeout_s`: the
        caller kills them and reports :meth:`exited`."""
        limit = self.policy.start_timeout_s
        return [
            p.name for p in self.procs.values() if p.state == STARTING and now - p.since > limit
        ]

    def given_up(self) -> list[str]:
        return [p.name for p in self.procs.values() if p.state == GIVEN_UP]

    def snapshot(self, now: float) -> list[dict[str, Any]]:
        """Per process: state, restarts, last exit code, seconds in that state, and
        seconds until its restart (backing off); for the state file."""
        return [
            {
                "name": p.name,
                "state": p.state,
                "restarts": p.restarts,
                "last_exit": p.last_exit,
                "for_s": round(now - p.since, 3),
                "restart_in_s": round(max(p.next_at - now, 0.0), 3)
                if p.state == BACKING_OFF
                else None,
            }
            for p in self.procs.values()
        ]

    def stats(self) -> dict[str, int]:
        states = [p.state for p in self.procs.values()]
        return {
            "processes": len(states),
            "running": states.count(RUNNING),
            "starting": states.count(STARTING),
            "backing_off": states.count(BACKING_OFF),
            "given_up": states.count(GIVEN_UP),
            "restarts": sum(p.restarts for p in self.procs.values()),
        }


# ---- the driver: a Supervisor over a LocalDeployment's processes --------------------

STATE_FILE = "up-state.json"


class Driver:
    """One :meth:`step` per tick of ``gcache up``'s loop: notice deaths and
    readiness, restart what is due (``LocalDeployment.respawn``), kill starts that
    take too long, and keep ``<data dir>/up-state.json`` (read by ``gcache status``)
    current. Processes without a ``respawn`` entry (router, engines) are watched
    only: a death is said once, never restarted."""

    def __init__(
        self,
        d: LocalDeployment,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = print,
        policy: Policy | None = None,
    ) -> None:
        self.d = d
        self.clock = clock
        self.say = say
        now = clock()
        self.sup = Supervisor(list(d.respawn), now, policy)
        for name in d.respawn:  # started and ready (LocalDeployment.start returned)
            self.sup.ready(name, now)
        self.reported: set[int] = set()  # pids of unsupervised processes said dead
        self.state_path = d.data_dir / STATE_FILE
        self._written = -1.0
        self.write_state(now)

    def step(self) -> None:
        now = self.clock()
        changed = False
        # Said after the state file is written: whoever reads a line ("server0 is
        # back") then reads a state that already shows it.
        said: list[str] = []
        procs = self.d.processes()
        for name, p in procs.items():
            if name in self.sup.procs or p.alive or p.popen.pid in self.reported:
                continue
            self.reported.add(p.popen.pid)
            said.append(f"{name} exited ({p.popen.returncode}); not supervised; see {p.log_path}")
        for name in self.sup.procs:
            state, cur = self.sup.state(name), procs.get(name)
            if cur is None or state not in (STARTING, RUNNING):
                continue
            p = cur
            if not p.alive:
                said.append(
                    self.sup.exited(name, p.popen.returncode, now).line + f"; see {p.log_path}"
                )
                changed = True
            elif state == STARTING and self.d.respawn[name].ready(p):
                self.sup.ready(name, now)
                said.append(
                    f"{name} is back (pid {p.popen.pid}, restart {self.sup.procs[name].restarts})"
                )
                changed = True
        for name in self.sup.overdue(now):
            p = procs[name]
            signal_group(p, signal.SIGKILL)
            p.popen.wait()
            said.append(
                self.sup.exited(name, p.popen.returncode, now).line
                + f" (not ready in {self.sup.policy.start_timeout_s:g} s; see {p.log_path})"
            )
            changed = True
        for name in self.sup.due(now):
            changed = True
            try:
                self.d.respawn[name].spawn()
            except (GCacheError, OSError) as exc:  # e.g. no log file, no more processes
                said.append(self.sup.exited(name, None, now).line + f": {exc}")
        if changed or now - self._written >= 1.0:
            self.write_state(now)
        for line in said:
            self.say(line)

    def write_state(self, now: float) -> None:
        """``up-state.json``: this ``gcache up``'s pid, the meta's gRPC address and
        one entry per supervised process (``Supervisor.snapshot`` plus its pid and
        port, and ``since``: wall-clock seconds when it entered its state)."""
        procs = self.d.processes()
        wall = time.time()
        rows = self.sup.snapshot(now)
        for row in rows:
            p = procs.get(row["name"])
            row["pid"] = p.popen.pid if p is not None else None
            row["port"] = p.port if p is not None else 0
            row["since"] = round(wall - row["for_s"], 3)
        body = {"pid": os.getpid(), "updated": round(wall, 3), "processes": rows}
        tmp = self.state_path.with_name(self.state_path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(body, indent=1))
            os.replace(tmp, self.state_path)
        except OSError:
            pass  # status shows less; serving goes on
        self._written = now

    def remove_state(self) -> None:
        for path in (self.state_path, self.state_path.with_name(self.state_path.name + ".tmp")):
            path.unlink(missing_ok=True)


def read_state(data_dir: str | Path) -> dict[str, Any] | None:
    """The state file of a running ``gcache up`` in ``data_dir`` (None: there is
    none, or the ``gcache up`` that wrote it is gone)."""
    try:
        body = json.loads((Path(data_dir) / STATE_FILE).read_text())
        pid = int(body["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return body if isinstance(body, dict) else None


def state_lines(body: dict[str, Any], wall: float | None = None) -> list[str]:
    """The processes table of ``gcache status``."""
    wall = time.time() if wall is None else wall
    lines = [
        f"{'process':<10} {'pid':>8} {'port':>6} {'state':<12} {'restarts':>8} "
        f"{'last exit':>9} {'for':>9}"
    ]
    for row in body.get("processes", []):
        last = "-" if row.get("last_exit") is None else str(row["last_exit"])
        state = row.get("state", "?")
        age = max(wall - float(row.get("since", wall)), 0.0)
        lines.append(
            f"{row.get('name', '?'):<10} {row.get('pid') or '-':>8} {row.get('port') or '-':>6} "
            f"{state:<12} {row.get('restarts', 0):>8} {last:>9} {age:>8.1f}s"
        )
    return lines
