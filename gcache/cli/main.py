"""``gcache``: ``up`` (a whole local deployment), ``status``, ``demo`` and ``replay``.
One file: the argument parser of every subcommand and its thin driver; the work
is in the modules each one calls."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from gcache.auth import summary as auth_summary
from gcache.cli.deploy import DeploymentInterrupted, LocalDeployment, fetch_stats
from gcache.cli.supervise import GIVEN_UP, Driver, Policy, read_state, state_lines
from gcache.config import ClientConfig, MetaConfig, ServerConfig, load
from gcache.errors import ConfigError, GCacheError
from gcache.leader import MetaFinder, is_etcd
from gcache.startup import EXIT_INTERRUPTED, OneLineParser, one_line, run_command


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def up_settings(args: argparse.Namespace, env: dict[str, str] | None = None) -> None:
    """Fill ``gcache up``'s unset address flags from the daemons' environment
    variables (GCACHE_META_HOST, GCACHE_META_PORT, GCACHE_META_GRPC_PORT,
    GCACHE_META_METRICS_PORT, GCACHE_SERVER_PORT), else the defaults; every value
    is checked as the daemons check it, so a bad one fails in one line naming it."""
    meta = load(MetaConfig, env=env)
    # gcache up gives each server its NVMe tier (--nvme-size, under --data-dir): the
    # environment's nvme_* settings are not used, so they cannot fail here.
    server = load(ServerConfig, env=env, overrides={"nvme_path": "", "nvme_size": "0"})
    flags = {"host": meta.host, "meta_port": meta.port, "grpc_port": meta.grpc_port}
    flags |= {"metrics_port": meta.metrics_port, "server_port": server.port}
    for name, value in flags.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    load(
        MetaConfig,
        env={},
        overrides={
            "host": args.host,
            "port": args.meta_port,
            "grpc_port": args.grpc_port,
            "metrics_port": args.metrics_port,
        },
    )
    last = args.server_port + max(args.servers - 1, 0) if args.server_port else 0
    load(
        ServerConfig,
        env={},
        overrides={
            "port": last,
            "capacity": args.capacity,
            "nvme_size": args.nvme_size,
            "nvme_path": "nvme" if args.nvme_size not in ("", "0") else "",
        },
    )
    if args.servers < 1:
        raise ConfigError(f"--servers must be >= 1, got {args.servers}")


def cmd_up(args: argparse.Namespace) -> int:
    up_settings(args)
    ports = [args.server_port + i if args.server_port else 0 for i in range(args.servers)]
    d = LocalDeployment(
        args.data_dir,
        servers=args.servers,
        capacity=args.capacity,
        host=args.host,
        meta_port=args.meta_port,
        grpc_port=args.grpc_port,
        metrics_port=args.metrics_port,
        server_ports=ports,
        log_level=args.log_level,
        nvme_size=args.nvme_size,
        ha=args.ha,
    )
    policy = Policy(
        initial_backoff_s=args.restart_backoff_s,
        max_backoff_s=max(args.restart_backoff_max_s, args.restart_backoff_s),
        max_restarts=args.max_restarts,
        window_s=args.restart_window_s,
        start_timeout_s=args.timeout,
    )
    stop = {"signal": 0}
    in_demo = {"now": False}

    def on_signal(signum: int, _frame: Any) -> None:
        # Start-up (and restarts) check d.interrupted between steps and stop at once;
        # only the demo, client code that may block, is interrupted by raising.
        stop["signal"] = d.interrupted = signum
        if in_demo["now"]:
            raise _Interrupted(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        d.start(timeout=args.timeout)
    except DeploymentInterrupted:
        codes = _quiet_stop(d)
        print(f"gcache up: interrupted while starting; stopped: {_codes(codes)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except GCacheError as exc:
        print(f"gcache up: {one_line(exc)}{_up_hint(str(exc))}", file=sys.stderr)
        _quiet_stop(d)
        return 1
    driver: Driver | None = None
    try:
        print("GCache is up:")
        print(f"  meta hot path   {d.meta_addr}")
        print(f"  meta gRPC       {d.meta_grpc}")
        print(f"  metrics         {d.metrics_url}")
        nvme = args.nvme_size not in ("", "0")
        for i, s in enumerate(d.servers):
            tier = f", {args.nvme_size} NVMe tier in {d.nvme_dir(i).resolve()}" if nvme else ""
            print(f"  {s.name:<15} {s.host}:{s.port}  ({args.capacity} DRAM segment{tier})")
        for line in _banner_tier(d):
            print("  " + line)
        if args.router:
            from gcache.cli.fleet import up_router

            for line in up_router(
                d, args.instances, args.engines, args.router_port, args.router_http_port
            ):
                print(line)
        print(f"  logs            {Path(args.data_dir).resolve()}")
        meta_cfg = load(MetaConfig)  # the daemons read the same environment
        print(
            "  auth            "
            + auth_summary(meta_cfg.cluster_token_file, meta_cfg.tenants_file, meta_cfg.tls_cert)
        )
        print(f"clients: GCacheClient(meta='{d.meta_addr}', meta_grpc='{d.meta_grpc}')")
        data_dir = Path(args.data_dir).resolve()
        print(f"status:  gcache status --meta-grpc {d.meta_grpc} --data-dir {data_dir}", flush=True)
        if args.demo and not stop["signal"]:
            in_demo["now"] = True
            run_workloads(
                d.client_config(), args.demo_workload, args.demo_conversations, args.demo_turns
            )
            in_demo["now"] = False
            print()
            print_status(d.stats())

        def say(line: str) -> None:
            print(f"gcache up: {line}", file=sys.stderr, flush=True)

        driver = Driver(d, say=say, policy=policy)
        if not stop["signal"]:
            print("\nserving; Ctrl-C to stop", flush=True)
        metas = [n for n in d.respawn if n.startswith("meta")]
        while not stop["signal"]:
            driver.step()
            if metas and all(driver.sup.state(n) == GIVEN_UP for n in metas):
                say("no meta left to restart; stopping the deployment")
                stop["signal"] = -1
                break
            time.sleep(0.1)
    except _Interrupted:
        pass
    except DeploymentInterrupted:
        pass
    except GCacheError as exc:
        print(f"gcache up: {one_line(exc)}", file=sys.stderr)
        stop["signal"] = -1
    finally:
        codes = _quiet_stop(d)
        if driver is not None:
            driver.remove_state()
        print(f"stopped: {_codes(codes)}", flush=True)
    return 0 if stop["signal"] != -1 else 1


def _banner_tier(d: LocalDeployment) -> list[str]:
    """The NVMe tier lines of ``gcache up``'s banner, from the meta (a restarted
    deployment's tiers hold what they held)."""
    try:
        return tier_lines(d.stats(), detail=False)
    except GCacheError as exc:
        return [f"NVMe tier    not known: {one_line(exc)}"]


class _Interrupted(Exception):
    """SIGINT/SIGTERM while ``gcache up`` starts or runs its demo."""


def _quiet_stop(d: LocalDeployment) -> dict[str, int | None]:
    """Stop the deployment with SIGINT/SIGTERM ignored, so a second Ctrl-C cannot
    leave processes behind."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return d.stop()
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def _codes(codes: dict[str, int | None]) -> str:
    return ", ".join(f"{k}={v}" for k, v in codes.items()) or "nothing was running"


_UP_FLAGS = {
    "meta.port": "--meta-port",
    "meta.grpc_port": "--grpc-port",
    "meta.metrics_port": "--metrics-port",
    "server.port": "--server-port",
}


def _up_hint(message: str) -> str:
    """For a port ``gcache up`` could not listen on: its flag for another port."""
    for setting, flag in _UP_FLAGS.items():
        if f"({setting}," in message:
            return f"; gcache up {flag} PORT picks another (0: any free)"
    return ""


def run_workloads(cfg: ClientConfig, which: str, conversations: int, turns: int) -> bool:
    """The built-in workloads; returns False if any check failed."""
    ok = True
    if which in ("chat", "both"):
        try:
            from gcache_client.engines.demo.chat import run_chat, summary
        except ImportError as exc:
            print(f"\n(model workload skipped: {exc}; install the 'hf' extra)")
        else:
            from gcache_client import GCacheClient

            print(
                "\nworkload 1: multi-turn chat, a real MiMo-V2-Flash-architecture model "
                "reusing its prefixes through GCache"
            )
            with GCacheClient(cfg) as gc:
                reports = run_chat(gc, conversations=conversations, turns=turns)
            for line in summary(reports):
                print("  " + line)
            ok = ok and all(r.exact for r in reports)
    if which in ("store", "both"):
        from gcache.cli.demo import run_demo

        print(
            "\nworkload 2: the store alone, full-size MiMo-V2-Flash KV layout (48 layers), "
            "byte-verified:"
        )
        rep = run_demo(cfg, conversations=conversations, turns=turns)
        print("summary:")
        for line in rep.lines():
            print("  " + line)
        ok = ok and rep.mismatches == 0
    return ok


def print_status(reply: Any) -> None:
    """Per server: what it holds, the reads it served over TCP and the writes it
    took (TCP WRITEs and sealed shared-memory writes). Shared-memory readers never
    talk to a server, so reads are also shown as the meta counts them: objects and
    bytes handed out by leased lookups, whichever path then read them. Sizes in
    binary units (KiB, MiB, GiB)."""
    if reply.role:  # one of several metas (--etcd)
        print(f"meta: {reply.role}, epoch {reply.epoch}, leader {reply.leader or 'unknown'}")
    print(
        f"{'server':<12} {'address':<22} {'alive':<6} {'capacity':>11} {'used':>11} "
        f"{'objects':>8} {'tcp reads':>10} {'tcp read':>11} {'writes':>8} {'written':>11}"
    )
    for s in reply.servers:
        k = s.counters
        print(
            f"{s.server_id:<12} {s.address:<22} {'yes' if s.alive else 'NO':<6} "
            f"{_fmt_bytes(s.capacity):>11} {_fmt_bytes(s.used):>11} {s.objects:>8} "
            f"{k.reads:>10} {_fmt_bytes(k.read_bytes):>11} {k.writes:>8} "
            f"{_fmt_bytes(k.write_bytes):>11}"
        )
    c = dict(reply.counters)
    if "leased_objects" in c:
        print(
            f"leased to readers (TCP and shared memory): {int(c['leased_objects'])} objects, "
            f"{_fmt_bytes(c.get('leased_bytes', 0))}"
        )
    else:
        print("leased to readers: not counted by this meta (shared-memory reads not shown)")
    lookups = c.get("lookup_blocks", 0)
    print(
        f"namespaces {reply.namespaces}, objects {int(c.get('objects', 0))}, "
        f"stored {_fmt_bytes(c.get('bytes_stored', 0))} "
        f"(full {_fmt_bytes(c.get('bytes_stored_full', 0))}, "
        f"windows {_fmt_bytes(sum(v for k, v in c.items() if k.startswith('bytes_stored_swa')))})"
    )
    print(
        f"lookups {int(c.get('lookups', 0))}, blocks hit {int(c.get('hit_blocks', 0))} of "
        f"{int(lookups)} ({c.get('block_hit_rate', 0):.1%}), misses "
        f"{int(lookups - c.get('hit_blocks', 0))}, evictions {int(c.get('evictions', 0))}, "
        f"active leases {int(c.get('active_leases', 0))}"
    )
    if "hotpath_connections_open" in c:  # the meta's hot-path connections
        print(
            f"hot path: {int(c['hotpath_connections_open'])} connections open "
            f"({int(c.get('hotpath_peers_connected', 0))} peers), "
            f"{int(c.get('hotpath_connections_accepted', 0))} accepted, "
            f"{int(c.get('hotpath_connections_refused', 0))} refused (busy), "
            f"{int(c.get('hotpath_connections_idle_closed', 0))} closed idle, "
            f"{int(c.get('hotpath_connections_send_timeouts', 0))} send timeouts, "
            f"{int(c.get('hotpath_protocol_errors', 0))} protocol errors"
        )
    for line in tier_lines(reply):
        print(line)


_TIER_HEAD = (
    f"{'NVMe tier':<12} {'size':>11} {'used':>11} {'used%':>6} {'objects':>8} "
    f"{'demotions':>10} {'in flight':>10} {'dropped':>8}"
)


def _tier_row(name: str, size: float, used: float, objects: float, done: float,
              flight: float, dropped: float) -> str:  # fmt: skip
    if not size:  # a server without a tier: what leaves its DRAM is dropped
        dashes = f"{'-':>11} {'-':>6} {'-':>8} {'-':>10} {'-':>10}"
        return f"{name:<12} {'none':>11} {dashes} {int(dropped):>8}"
    return (
        f"{name:<12} {_fmt_bytes(size):>11} {_fmt_bytes(used):>11} {used / size:>6.1%} "
        f"{int(objects):>8} {int(done):>10} {int(flight):>10} {int(dropped):>8}"
    )


def tier_lines(reply: Any, detail: bool = True) -> list[str]:
    """The NVMe tier per server and in total: size, used (objects plus demotions in
    flight), objects, demotions finished and in flight, and ``dropped``: objects
    that left DRAM with no NVMe copy (``dropped_not_demoted``). A server's row
    counts since it registered; the total row's demotions and drops are the meta's
    counters since it started. ``detail``: a line with the drops' reasons and how
    often demotion was behind (``gcache status``)."""
    servers = list(reply.servers)
    c = dict(reply.counters)
    if not any(s.nvme_capacity for s in servers):
        return [
            "NVMe tier    none: what leaves DRAM is dropped (gcache up --nvme-size SIZE; "
            "gcache-server --nvme-path DIR --nvme-size SIZE)"
        ]
    lines = [_TIER_HEAD]
    for s in servers:
        lines.append(
            _tier_row(s.server_id, s.nvme_capacity, s.nvme_used, s.nvme_objects, s.demotions,
                      s.demotions_in_flight, s.dropped_not_demoted)
        )  # fmt: skip
    live = [s for s in servers if s.alive]
    lines.append(
        _tier_row(
            "total",
            sum(s.nvme_capacity for s in live),
            sum(s.nvme_used for s in live),
            sum(s.nvme_objects for s in live),
            c.get("demotions_done", sum(s.demotions for s in servers)),
            sum(s.demotions_in_flight for s in live),
            c.get("dropped_not_demoted", sum(s.dropped_not_demoted for s in servers)),
        )
    )
    if detail and "dropped_no_tier" in c:
        lines.append(
            f"dropped: {int(c['dropped_not_demoted'])} left DRAM with no NVMe copy "
            f"(tier off or paused {int(c['dropped_no_tier'])}, tier short of room and "
            f"not worth a disk write {int(c['dropped_not_worth'])}, tier full "
            f"{int(c['dropped_tier_full'])}, put could not wait "
            f"{int(c['dropped_put_could_not_wait'])}); demotion behind "
            f"{int(c.get('demotion_behind', 0))} times, puts that waited for it "
            f"{int(c.get('demotion_behind_waits', 0))}"
        )
    return lines


def resolve_grpc(meta_grpc: str) -> str:
    """An etcd:// address -> the leader's gRPC address (one line when none)."""
    if not is_etcd(meta_grpc):
        return meta_grpc.split(",")[0]
    found = asyncio.run(MetaFinder(meta_grpc).find(2.0))
    if found is None:
        raise GCacheError(f"no meta leader in {meta_grpc} (or etcd unreachable)")
    return found[1]


def cmd_status(args: argparse.Namespace) -> int:
    state = None if args.json else read_state(args.data_dir)
    if state is not None:  # a gcache up runs there: its processes first (even with no meta)
        for line in state_lines(state):
            print(line)
        print(flush=True)
    reply = fetch_stats(resolve_grpc(args.meta_grpc))
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(reply), indent=2))
    else:
        print_status(reply)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    cfg = ClientConfig(meta=args.meta, meta_grpc=args.meta_grpc)
    cfg.check()
    try:  # before loading a model: fail in one line when nothing runs there
        fetch_stats(args.meta_grpc, timeout=3.0)
    except GCacheError as exc:
        raise GCacheError(f"{exc}; start a deployment first (gcache up)") from exc
    return 0 if run_workloads(cfg, args.workload, args.conversations, args.turns) else 1


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(prog="gcache", description="GCache command line")
    sub = parser.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser(
        "up",
        help="start a meta and N servers on this host, until Ctrl-C",
        description="Start gcache-meta and N gcache-server processes, wait until "
        "they are healthy, print the endpoints, serve until Ctrl-C/SIGTERM. A process "
        "that dies is restarted with the same identity (same server id, ports, data "
        "and NVMe directories; a server re-adopts its segment, the meta rebuilds from "
        "the servers' reports) after a back-off that doubles from --restart-backoff-s "
        "up to --restart-backoff-max-s (back to the start once it ran 30 s); one "
        "restarted more than --max-restarts times within --restart-window-s is given "
        "up on (said in one line; if that is the meta, gcache up stops and exits 1). "
        "Each restart is one line on stderr and shows in `gcache status --data-dir`. "
        "Ctrl-C/SIGTERM at any moment, start-up included, stops every process "
        "(SIGTERM, SIGKILL after 10 s) and removes their segments, manifests and "
        "staging files from /dev/shm and their ready files; the logs and the NVMe "
        "tiers in --data-dir stay.",
    )
    up.add_argument("--servers", type=int, default=2, help="storage daemons (default 2)")
    up.add_argument(
        "--ha",
        action="store_true",
        help="high availability: a local etcd (/usr/bin/etcd, data under --data-dir) and "
        "two metas elected through it; servers and clients follow the leader",
    )
    up.add_argument(
        "--capacity",
        default="1GiB",
        help="DRAM segment per server (default 1GiB; 1G = 1GiB, 1GB = 10**9 bytes)",
    )
    up.add_argument(
        "--nvme-size",
        default="256MiB",
        help="NVMe tier per server, under --data-dir (default 256MiB; 0 turns it off)",
    )
    up.add_argument("--host", help="listen address (default $GCACHE_META_HOST, else 127.0.0.1)")
    up.add_argument(
        "--meta-port",
        type=int,
        help="hot-path port (default $GCACHE_META_PORT, else 7700; 0: any free)",
    )
    up.add_argument(
        "--grpc-port",
        type=int,
        help="gRPC port (default $GCACHE_META_GRPC_PORT, else 7701; 0: any free)",
    )
    up.add_argument(
        "--metrics-port",
        type=int,
        help="Prometheus /metrics port (default $GCACHE_META_METRICS_PORT, else 7702; "
        "0: any free, -1: off)",
    )
    up.add_argument(
        "--server-port",
        type=int,
        help="first server port, server i gets +i (default $GCACHE_SERVER_PORT, else "
        "7800; 0: any free)",
    )
    up.add_argument("--data-dir", default="gcache-data", help="logs and ready files")
    up.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help="seconds to become healthy (also for each restarted process)",
    )
    up.add_argument(
        "--restart-backoff-s",
        type=float,
        default=0.5,
        help="first wait before restarting a dead process (default 0.5; doubles)",
    )
    up.add_argument(
        "--restart-backoff-max-s",
        type=float,
        default=10.0,
        help="longest wait before a restart (default 10)",
    )
    up.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts of one process within --restart-window-s before giving up on it "
        "(default 5; 0: never restart)",
    )
    up.add_argument(
        "--restart-window-s", type=float, default=60.0, help="see --max-restarts (default 60)"
    )
    up.add_argument("--log-level", default="info")
    up.add_argument("--demo", action="store_true", help="run the built-in workload once up")
    up.add_argument("--demo-conversations", type=int, default=2)
    up.add_argument("--demo-turns", type=int, default=4)
    up.add_argument(
        "--demo-workload",
        choices=["chat", "store", "both"],
        default="both",
        help="chat: a real model reusing prefixes; store: raw KV put/get",
    )
    up.add_argument(
        "--router",
        action="store_true",
        help="also start gcache-router in front of --instances and/or --engines",
    )
    up.add_argument(
        "--instances",
        default="",
        help="engine instances for the router, comma-separated [ID=]URL[@EVENTS] "
        "(EVENTS: the instance's KV-event ZMQ endpoint, tcp://host:5557)",
    )
    up.add_argument(
        "--engines",
        type=int,
        default=0,
        help="start this many gcache-engine instances (a tiny model) behind the router",
    )
    up.add_argument("--router-port", type=int, default=7900, help="router hot path (0: any free)")
    up.add_argument(
        "--router-http-port", type=int, default=7901, help="router HTTP front (0: any free)"
    )
    up.set_defaults(func=cmd_up)

    st = sub.add_parser("status", help="servers, capacity, usage, objects, hits and misses")
    st.add_argument("--meta-grpc", default="127.0.0.1:7701", help="meta gRPC address")
    st.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    st.add_argument(
        "--data-dir",
        default="gcache-data",
        help="a running gcache up's data directory: its processes (state, restarts, last "
        "exit code) are shown first, from its up-state.json (default gcache-data)",
    )
    st.set_defaults(func=cmd_status)

    demo = sub.add_parser("demo", help="run the built-in workload against a running deployment")
    demo.add_argument("--meta", default="127.0.0.1:7700")
    demo.add_argument("--meta-grpc", default="127.0.0.1:7701")
    demo.add_argument("--conversations", type=int, default=2)
    demo.add_argument("--workload", choices=["chat", "store", "both"], default="both")
    demo.add_argument("--turns", type=int, default=4)
    demo.set_defaults(func=cmd_demo)

    from gcache.replay.cli import add_parser as add_replay

    add_replay(sub)

    args = parser.parse_args(argv)
    raise SystemExit(run_command(f"gcache {args.cmd}", args.func, args))


if __name__ == "__main__":
    main()
