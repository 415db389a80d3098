"""ReportObjects against a real gcache-meta: the reply accounts
for every reported record: adopted + dropped + parked (still waiting for a parent
block another server may report) = reported."""

from __future__ import annotations

from pathlib import Path

import grpc
import msgspec

from gcache import keys
from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.cli.deploy import LocalDeployment
from gcache.layout import Layout
from tests.kvdata import tiny_hybrid


def test_report_reply_counts_adopted_dropped_and_parked(tmp_path: Path) -> None:
    spec = tiny_hybrid()
    layout = Layout(spec)
    with LocalDeployment(tmp_path, servers=0, metrics_port=-1) as d:
        d.start()
        with grpc.insecure_channel(d.meta_grpc) as ch:
            stub = pb_grpc.ControlStub(ch)
            fp = stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(
                    model="report-reply",
                    layout_json=msgspec.json.encode(spec).decode(),
                    kv_dtype=spec.dtype,
                ),
                timeout=10,
            ).fingerprint
            reg = stub.RegisterServer(
                pb.RegisterServerRequest(
                    server_id="r0",
                    host="127.0.0.1",
                    port=41000,
                    hostname="h",
                    capacity=64 << 20,
                    secret=bytes(range(16)),
                    incarnation=3,
                    objects=4,
                ),
                timeout=10,
            )
            ks = keys.block_keys(fp, list(range(4 * 4)), layout.block_size)
            size, sums = layout.group_object_bytes[0], bytes(8 * len(layout.group_layers[0]))

            def rec(pos: int, offset: int, parent: bytes | None = None) -> pb.StoredObject:
                par = ks[pos - 1] if pos else b""
                return pb.StoredObject(
                    namespace=fp, key=ks[pos], parent=par if parent is None else parent,
                    pos=pos, group=0, tier=0, offset=offset, length=size, sums=sums, seq=pos,
                )  # fmt: skip

            objects = [
                rec(0, 0),
                rec(1, 4096),
                rec(3, 8192),  # its parent (block 2) is on no server: parked
                rec(1, 4096 + 1),  # misaligned: dropped
            ]
            reply = stub.ReportObjects(
                iter(
                    [
                        pb.ReportObjectsRequest(
                            server_id="r0",
                            incarnation=3,
                            epoch=reg.epoch,
                            objects=objects,
                            last=True,
                        )
                    ]
                ),
                timeout=10,
            )
            assert (reply.adopted, reply.dropped, reply.parked) == (2, 1, 1)
            assert reply.adopted + reply.dropped + reply.parked == len(objects)
