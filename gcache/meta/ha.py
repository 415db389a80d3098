"""Drives :class:`~gcache.meta.election.Election` with etcd (``aetcd``).

Standby: every ``ttl/6`` read ``PREFIX/leader`` and ``PREFIX/epoch``; when no
leader is named, take a lease of the TTL and, in one transaction that requires
the leader key absent and the epoch key unchanged, write the leader record under
the lease and the new epoch. Leader: a keep-alive every ``ttl/3``, and a read
of the leader key now and then (someone deleting it by hand also ends the term).
Stepping down: the daemon replaces its process (``ha.py`` only reports it)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from gcache.leader import EtcdTarget, LeaderRecord
from gcache.meta.election import Election, Role

log = logging.getLogger("gcache.meta.ha")


class EtcdElection:
    def __init__(
        self,
        election: Election,
        target: EtcdTarget,
        record: Callable[[int], LeaderRecord],
        on_leader: Callable[[int], None],
        on_step_down: Callable[[str], None],
    ) -> None:
        self.election = election
        self.target = target
        self.record = record  # the leader record of this meta for an epoch
        self.on_leader = on_leader
        self.on_step_down = on_step_down
        self._client: Any = None
        self._endpoint = 0
        self._lease: Any = None
        self.failures = 0
        self.campaigns = 0

    async def _connect(self) -> Any:
        import aetcd

        if self._client is None:
            host, port = self.target.endpoints[self._endpoint % len(self.target.endpoints)]
            self._client = aetcd.Client(host, port, timeout=self.election.ttl_s / 3)
        return self._client

    async def _drop_client(self) -> None:
        client, self._client = self._client, None
        self._endpoint += 1
        if client is not None:
            try:
                await client.close()
            except Exception:
                pass

    async def _read(self, client: Any) -> tuple[LeaderRecord | None, int, bytes | None]:
        """The leader record, the stored epoch and its raw value (None: absent)."""
        got = await client.get(self.target.leader_key)
        ep = await client.get(self.target.epoch_key)
        leader = None if got is None else LeaderRecord.decode(got.value)
        raw = None if ep is None else bytes(ep.value)
        stored = int(raw) if raw is not None and raw.isdigit() else 0
        return leader, stored, raw

    async def _campaign(self, client: Any, stored_raw: bytes | None) -> None:
        el = self.election
        tx = client.transactions
        sent_at = time.monotonic()
        lease = await client.lease(max(1, round(el.ttl_s)))
        epoch = el.campaign_epoch(int(time.time() * 1000))
        rec = self.record(epoch)
        same_epoch = (
            tx.version(self.target.epoch_key) == 0
            if stored_raw is None
            else tx.value(self.target.epoch_key) == stored_raw
        )
        ok, _ = await client.transaction(
            compare=[tx.version(self.target.leader_key) == 0, same_epoch],
            success=[
                tx.put(self.target.leader_key, rec.encode(), lease),
                tx.put(self.target.epoch_key, str(epoch).encode()),
            ],
            failure=[],
        )
        self.campaigns += 1
        if not ok:
            await client.revoke_lease(lease.id)
            return
        self._lease = lease
        el.won(epoch, rec, sent_at, float(lease.ttl))
        log.info("this meta is the leader now (epoch %d)", epoch)
        self.on_leader(epoch)

    async def step(self) -> float:
        """One round; returns how long to wait before the next."""
        el = self.election
        client = await self._connect()
        if el.role is Role.STANDBY:
            leader, stored, raw = await self._read(client)
            el.observe(leader, stored, time.monotonic())
            if el.should_campaign(time.monotonic()):
                await self._campaign(client, raw)
            return el.ttl_s / 6 if el.role is Role.STANDBY else el.keepalive_every()
        if el.role is Role.LEADER:
            sent_at = time.monotonic()
            reply = await client.refresh_lease(self._lease.id)
            ttl = float(reply.TTL) if reply is not None else 0.0
            el.refreshed(sent_at, ttl, time.monotonic())
            if el.role is Role.LEADER:
                leader, stored, _ = await self._read(client)
                el.observe(leader, stored, time.monotonic())
            wait = el.keepalive_every() - (time.monotonic() - sent_at)
            return max(wait, 0.0)
        return 0.0

    async def run(self) -> None:
        el = self.election
        while not el.stepping_down():
            try:
                wait = await self.step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # aetcd/grpc errors: etcd not reachable
                self.failures += 1
                was = el.degraded
                el.unreachable(time.monotonic())
                if el.degraded and not was:
                    log.warning("etcd unreachable (%s); the leader serves on", exc)
                elif self.failures % 20 == 1:
                    log.warning("etcd unreachable: %r", exc)
                await self._drop_client()
                wait = el.ttl_s / 6
            if not el.stepping_down():
                await asyncio.sleep(wait)
        log.warning("this meta steps down: %s", el.why)
        self.on_step_down(el.why)

    async def close(self) -> None:
        """A clean stop: give the lease back so a standby takes over at once."""
        if self._lease is not None and self._client is not None:
            try:
                await asyncio.wait_for(self._client.revoke_lease(self._lease.id), 1.0)
            except Exception:
                pass
        await self._drop_client()

    def stats(self) -> dict[str, float]:
        return {
            **self.election.stats(time.monotonic()),
            "ha_etcd_failures": float(self.failures),
            "ha_campaigns": float(self.campaigns),
        }
