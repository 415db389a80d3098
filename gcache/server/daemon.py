"""``gcache-server``: one DRAM segment served over the framed TCP data plane.

Structure (uvicorn-style): :class:`StorageServer` is the lifecycle (listen, open
the segment and its tiers, start, stop, clean up); the data plane
(:mod:`gcache.server.dataplane`: one handler per message type on the framed
daemon skeleton) moves bytes, :class:`~gcache.server.core.DataPlaneCore` decides,
and the control loop (:mod:`gcache.server.control`) registers and heartbeats
over gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket

from gcache import config as cfgmod
from gcache.config import ServerConfig
from gcache.server.control import ControlLoop
from gcache.server.core import DataPlaneCore
from gcache.server.dataplane import DataPlane
from gcache.server.staging import StagingArea, remove_dead_staging_files, staging_path
from gcache.server.tiers import TierState
from gcache.startup import OneLineParser, install_uvloop, listen_tcp, run_main, setup_logging
from gcache.storage.segment import Segment

log = logging.getLogger("gcache.server")


class StorageServer:
    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        self._stopping = asyncio.Event()
        self.dataplane = DataPlane(cfg)
        self.dataplane.stats_source = self.stats
        self.control = ControlLoop(cfg, self.dataplane, self._stopping)
        self.segment: Segment | None = None
        self.core: DataPlaneCore | None = None
        self.tiers: TierState | None = None  # manifest, NVMe tier, demotions, epoch
        self.server_id = cfg.server_id
        self.port = cfg.port

    def stats(self) -> dict[str, int | float]:
        """Connection counters of the data plane (the core keeps its own), the
        control loop's, and the tiers' (manifest, NVMe, demotions, epoch)."""
        return {
            **self.dataplane.stats(),
            **self.control.stats(),
            **(self.tiers.stats() if self.tiers is not None else {}),
        }

    async def run(self) -> None:
        cfg = self.cfg
        # SIGINT/SIGTERM from here on, start-up included, end in the cleanup below:
        # the segment is made (reserved, pre-faulted) on a worker thread a signal
        # cannot cut short, so a stop asked meanwhile is honoured right after it.
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stopping.set)
        dp, control = self.dataplane, self.control
        listener = listen_tcp(cfg.host, cfg.port, "server.port, --port", 512)
        dp.listener = listener
        self.port = control.port = listener.getsockname()[1]
        if not self.server_id:
            self.server_id = f"{socket.gethostname()}:{self.port}"
        control.server_id = self.server_id
        path = os.path.join(cfg.shm_dir, Segment.file_name(self.server_id))
        # A killed predecessor's staging file (with or without a tier now).
        for name in remove_dead_staging_files(cfg.shm_dir, path):
            log.warning("removed staging file %s of a dead process", name)
        try:
            self.tiers = await TierState.open(cfg, self.server_id, path)  # off the loop
        except BaseException:
            listener.close()
            raise
        ready = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []
        try:
            await self._start_serving(path, ready, tasks)
            if ready.is_set() and cfg.ready_file:
                with open(cfg.ready_file + ".tmp", "w") as fh:
                    fh.write(f"{cfg.host} {self.port}\n")
                os.replace(cfg.ready_file + ".tmp", cfg.ready_file)
            await self._stopping.wait()
            if control.fatal is not None:
                raise control.fatal
        finally:
            log.info(
                "gcache-server %s stopping%s",
                self.server_id,
                "" if ready.is_set() else " (before it was ready)",
            )
            listener.close()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await dp.close()  # its connections, read pool and buffers, staging file
            # Keeps the segment and its manifest for the next start, unless this start
            # made it and stopped before registering: then it holds nothing.
            self.tiers.close(keep=ready.is_set() or self.tiers.segment.reused)

    async def _start_serving(
        self, path: str, ready: asyncio.Event, tasks: list[asyncio.Task[None]]
    ) -> None:
        """The rest of start-up (staging file, data and control loops), then wait
        until registered or stopped (``ready``; ``tasks`` gets the loops)."""
        cfg = self.cfg
        assert self.tiers is not None
        dp, control = self.dataplane, self.control
        self.tiers.on_report = control.beat_soon.set
        self.segment = control.segment = self.tiers.segment
        control.tiers = self.tiers
        self.core = dp.core = control.core = DataPlaneCore(
            self.segment, control.secret, nvme=self.tiers.nvme, recorder=self.tiers.record_writes
        )
        if self.tiers.nvme is not None and cfg.staging_size_bytes and not self._stopping.is_set():
            dp.staging = await asyncio.to_thread(  # reserves and faults in: off the loop
                StagingArea,
                staging_path(self.segment.path),
                cfg.staging_size_bytes,
                cfg.staging_ttl_s,
                max(cfg.staging_size_bytes // 2, 4096),
            )
        if self._stopping.is_set():
            return
        log.info(
            "gcache-server %s: %d-byte segment at %s, data plane on %s:%d",
            self.server_id,
            self.segment.capacity,
            path,
            cfg.host,
            self.port,
        )
        tasks += [
            asyncio.create_task(dp.accept_loop(self._stopping.is_set)),
            asyncio.create_task(control.control_loop(ready)),
        ]
        await asyncio.wait(
            [asyncio.create_task(ready.wait()), asyncio.create_task(self._stopping.wait())],
            return_when=asyncio.FIRST_COMPLETED,
        )


def main(argv: list[str] | None = None) -> None:
    parser = OneLineParser(
        prog="gcache-server",
        description="GCache storage daemon: one DRAM segment in shared memory served "
        "over framed TCP; registers with and heartbeats to gcache-meta.",
    )
    cfgmod.add_arguments(parser, ServerConfig)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)

    def body() -> None:
        cfg = cfgmod.from_args(ServerConfig, args)
        install_uvloop()
        asyncio.run(StorageServer(cfg).run())

    run_main("gcache-server", log, body)


if __name__ == "__main__":
    main()
