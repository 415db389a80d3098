"""``gcache up``'s restart decisions (gcache/cli/supervise.py), fed directly."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcache.cli.supervise import (
    BACKING_OFF,
    GIVEN_UP,
    RUNNING,
    STARTING,
    STATE_FILE,
    Policy,
    Supervisor,
    read_state,
    state_lines,
)
from gcache.errors import ConfigError

POL = Policy(initial_backoff_s=0.5, max_backoff_s=10, reset_after_s=30, max_restarts=5, window_s=60)


def test_restart_after_backoff_then_running() -> None:
    s = Supervisor(["meta", "server0"], 0.0, POL)
    s.ready("meta", 0.1)
    s.ready("server0", 0.1)
    d = s.exited("server0", -9, 5.0)
    assert d.state == BACKING_OFF and d.delay_s == 0.5
    assert d.line == "server0 exited (-9); restarting it in 0.5 s (restart 1)"
    assert s.due(5.4) == []
    assert s.due(5.5) == ["server0"]
    assert s.due(5.6) == []  # handed out once
    assert s.state("server0") == STARTING and s.state("meta") == RUNNING
    s.ready("server0", 6.0)
    snap = {r["name"]: r for r in s.snapshot(7.0)}
    assert snap["server0"]["restarts"] == 1 and snap["server0"]["last_exit"] == -9
    assert snap["server0"]["state"] == RUNNING and snap["server0"]["for_s"] == 1.0
    assert snap["meta"]["restarts"] == 0 and snap["meta"]["last_exit"] is None


def test_backoff_doubles_to_its_bound_and_resets_after_a_long_run() -> None:
    pol = Policy(initial_backoff_s=0.5, max_backoff_s=3, max_restarts=100, window_s=60)
    s = Supervisor(["m"], 0.0, pol)
    now, delays = 0.0, []
    for _ in range(6):  # dies 1 s after each start
        s.ready("m", now)
        now += 1
        delays.append(s.exited("m", 1, now).delay_s)
        now += delays[-1]
        assert s.due(now) == ["m"]
    assert delays == [0.5, 1, 2, 3, 3, 3]
    s.ready("m", now)
    now += pol.reset_after_s  # stayed up long enough
    assert s.exited("m", 1, now).delay_s == 0.5


def test_gives_up_after_max_restarts_in_window_and_never_restarts() -> None:
    s = Supervisor(["server1"], 0.0, POL)
    now = 0.0
    for _ in range(POL.max_restarts):
        s.ready("server1", now)
        d = s.exited("server1", 1, now + 0.1)
        now += 0.1 + d.delay_s
        assert s.due(now) == ["server1"]
    d = s.exited("server1", 1, now + 0.1)
    assert d.state == GIVEN_UP and s.given_up() == ["server1"]
    assert d.line == "server1 exited (1); restarted 5 times in 60 s already, giving up on it"
    assert s.due(now + 1e6) == [] and s.next_due() is None
    with pytest.raises(ValueError):
        s.exited("server1", 1, now + 2)


def test_restarts_outside_the_window_do_not_count() -> None:
    pol = Policy(max_restarts=2, window_s=10, reset_after_s=1000)
    s = Supervisor(["x"], 0.0, pol)
    now = 0.0
    for _ in range(10):  # one death every 20 s: never more than 1 restart in 10 s
        d = s.exited("x", 1, now)
        assert d.state == BACKING_OFF
        now += d.delay_s
        assert s.due(now) == ["x"]
        now += 20
    assert s.procs["x"].restarts == 10


def test_start_that_never_gets_ready_is_overdue() -> None:
    s = Supervisor(["meta"], 0.0, Policy(start_timeout_s=5))
    assert s.overdue(4.9) == []
    assert s.overdue(5.1) == ["meta"]
    d = s.exited("meta", None, 5.1)
    assert d.line.startswith("meta could not be started; restarting it in 0.5 s")
    s.due(5.6)
    s.ready("meta", 6.0)
    assert s.overdue(100) == []


def test_bad_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        Policy(initial_backoff_s=0)
    with pytest.raises(ConfigError):
        Policy(initial_backoff_s=5, max_backoff_s=1)
    with pytest.raises(ConfigError):
        Policy(max_restarts=-1)


# ---- invariants, over random event sequences ------------------------------------------

EVENT = st.tuples(
    st.sampled_from(["die", "ready", "tick", "due", "overdue"]),
    st.integers(0, 2),  # which process
    st.floats(0, 20, allow_nan=False),  # time passing before the event
)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(EVENT, max_size=80),
    st.integers(0, 6),
    st.floats(0.1, 2),
    st.floats(2, 15),
)
def test_invariants(
    events: list[tuple[str, int, float]], max_restarts: int, initial: float, bound: float
) -> None:
    pol = Policy(
        initial_backoff_s=initial,
        max_backoff_s=bound,
        max_restarts=max_restarts,
        window_s=30,
        reset_after_s=10,
        start_timeout_s=8,
    )
    names = ["meta", "server0", "server1"]
    s = Supervisor(names, 0.0, pol)
    live = {n: 1 for n in names}  # instances alive per identity (the model)
    gave_up: set[str] = set()
    restarts = dict.fromkeys(names, 0)
    now = 0.0
    for kind, i, dt in events:
        now += dt
        name = names[i]
        state = s.state(name)
        if kind == "die" and state in (STARTING, RUNNING):
            d = s.exited(name, -9, now)
            live[name] -= 1
            assert 0 < d.delay_s <= bound or d.state == GIVEN_UP
            assert initial <= s.procs[name].backoff_s <= bound
            if d.state == GIVEN_UP:
                gave_up.add(name)
        elif kind == "ready":
            s.ready(name, now)
        elif kind == "due":
            for n in s.due(now):
                assert n not in gave_up  # a given-up process is never restarted
                live[n] += 1
                restarts[n] += 1
        elif kind == "overdue":
            for n in s.overdue(now):
                s.exited(n, None, now)
                live[n] -= 1
                if s.state(n) == GIVEN_UP:
                    gave_up.add(n)
        for n in names:
            assert live[n] in (0, 1)  # never two live instances of one identity
            st_ = s.state(n)
            assert (live[n] == 1) == (st_ in (STARTING, RUNNING))
            if n in gave_up:
                assert st_ == GIVEN_UP
            if st_ == BACKING_OFF:
                assert s.procs[n].next_at - now <= bound + 1e-9
            assert s.procs[n].restarts == restarts[n]
            # at most max_restarts restarts inside any window before giving up
            assert len(s.procs[n].recent) <= max_restarts
    assert s.stats()["restarts"] == sum(restarts.values())


# ---- the state file and gcache status's table -------------------------------------------


def test_state_file_of_a_live_gcache_up_is_read(tmp_path: Path) -> None:
    body = {
        "pid": os.getpid(),
        "updated": 100.0,
        "processes": [
            {"name": "meta", "state": RUNNING, "restarts": 0, "last_exit": None, "pid": 11,
             "port": 7701, "since": 90.0},
            {"name": "server0", "state": BACKING_OFF, "restarts": 2, "last_exit": -9,
             "pid": 12, "port": 7800, "since": 99.0},
        ],
    }  # fmt: skip
    (tmp_path / STATE_FILE).write_text(json.dumps(body))
    got = read_state(tmp_path)
    assert got == body
    lines = state_lines(body, wall=100.0)
    header = ["process", "pid", "port", "state", "restarts", "last", "exit", "for"]
    assert lines[0].split() == header
    assert lines[2].split() == ["server0", "12", "7800", "backing-off", "2", "-9", "1.0s"]
    assert lines[1].split() == ["meta", "11", "7701", "running", "0", "-", "10.0s"]


def test_state_file_of_a_dead_gcache_up_is_ignored(tmp_path: Path) -> None:
    assert read_state(tmp_path) is None
    (tmp_path / STATE_FILE).write_text("{not json")
    assert read_state(tmp_path) is None
    dead = 2**22 + 12345  # above pid_max's default range: no such process
    (tmp_path / STATE_FILE).write_text(json.dumps({"pid": dead, "processes": []}))
    assert read_state(tmp_path) is None
