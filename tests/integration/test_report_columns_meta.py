"""A real gcache-meta and a columnar ReportObjects: a truncated chunk is
refused with INVALID_ARGUMENT and one log line, nothing of it adopted, what earlier
chunks adopted kept."""

from __future__ import annotations

from pathlib import Path

import grpc
import msgspec
import pytest

from gcache import keys
from gcache._proto import gcache_pb2 as pb
from gcache._proto import gcache_pb2_grpc as pb_grpc
from gcache.cli.deploy import LocalDeployment
from gcache.layout import Layout
from gcache.storage import columns
from gcache.storage.record import StoredRecord
from tests.kvdata import tiny_hybrid


def test_real_meta_refuses_a_bad_chunk_in_one_line_and_keeps_earlier_ones(
    tmp_path: Path,
) -> None:
    spec = tiny_hybrid()
    layout = Layout(spec)
    with LocalDeployment(tmp_path, servers=0, metrics_port=-1) as d:
        d.start()
        with grpc.insecure_channel(d.meta_grpc) as ch:
            stub = pb_grpc.ControlStub(ch)
            fp = stub.RegisterNamespace(
                pb.RegisterNamespaceRequest(
                    model="cols-refused",
                    layout_json=msgspec.json.encode(spec).decode(),
                    kv_dtype=spec.dtype,
                ),
                timeout=10,
            ).fingerprint
            reg = stub.RegisterServer(
                pb.RegisterServerRequest(
                    server_id="c0", host="127.0.0.1", port=41001, hostname="h",
                    capacity=64 << 20, secret=bytes(range(16)), incarnation=3, objects=4,
                ),
                timeout=10,
            )  # fmt: skip
            assert reg.report_columns, "this meta takes columnar reports"
            ks = keys.block_keys(fp, list(range(4 * layout.block_size)), layout.block_size)
            size, nsums = layout.group_object_bytes[0], len(layout.group_layers[0])
            recs = [
                StoredRecord(
                    fp, k, ks[i - 1] if i else b"", i, 0, 0, i * 4096, size, bytes(8 * nsums), i
                )
                for i, k in enumerate(ks)
            ]
            good = columns.encode(recs[:2])
            bad = columns.encode(recs[2:])
            bad.pos = bad.pos[:-1]  # truncated
            head = {"server_id": "c0", "incarnation": 3, "epoch": reg.epoch}
            chunks = [
                pb.ReportObjectsRequest(columns=good, **head),
                pb.ReportObjectsRequest(columns=bad, last=True, **head),
            ]
            with pytest.raises(grpc.RpcError) as err:
                stub.ReportObjects(iter(chunks), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "column pos" in (err.value.details() or "")
            stats = stub.GetStats(pb.GetStatsRequest(), timeout=10)
            assert stats.counters["objects"] == 2, "the good chunk stays, nothing of the bad"
    log = (tmp_path / "meta.log").read_text()
    lines = [ln for ln in log.splitlines() if "column pos" in ln]
    assert len(lines) == 1 and "Traceback" not in log
