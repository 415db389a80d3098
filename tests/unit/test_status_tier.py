"""The NVMe tier in ``gcache status`` and the ``gcache up`` banner
(``gcache.cli.main.tier_lines``), from a ``GetStats`` reply as a meta sends it: a
row per server and a total row (size, used, objects, demotions, drops), a line with
the drops' reasons, and one line when no server has a tier."""

from __future__ import annotations

import contextlib
import io

from gcache._proto import gcache_pb2 as pb
from gcache.cli.main import print_status, tier_lines

MiB = 1 << 20
GiB = 1 << 30


def reply(**counters: float) -> pb.GetStatsReply:
    servers = [
        pb.ServerStats(server_id="server0", address="127.0.0.1:7800", alive=True,
                       capacity=256 * MiB, nvme_capacity=GiB, nvme_used=GiB // 4,
                       nvme_objects=170, demotions=170, demotions_in_flight=3,
                       dropped_not_demoted=0),
        pb.ServerStats(server_id="server1", address="127.0.0.1:7801", alive=True,
                       capacity=256 * MiB, nvme_capacity=GiB, nvme_used=GiB // 2,
                       nvme_objects=169, demotions=169, dropped_not_demoted=2),
        pb.ServerStats(server_id="server2", address="127.0.0.1:7802", alive=True,
                       capacity=256 * MiB, dropped_not_demoted=5),
    ]  # fmt: skip
    return pb.GetStatsReply(servers=servers, counters=counters)


def cells(line: str) -> str:
    return " ".join(line.split())


def test_rows_per_server_and_a_total() -> None:
    lines = tier_lines(
        reply(demotions_done=339, dropped_not_demoted=7, dropped_no_tier=5, dropped_not_worth=2,
              dropped_tier_full=0, dropped_put_could_not_wait=0, demotion_behind=4,
              demotion_behind_waits=1)
    )  # fmt: skip
    assert cells(lines[0]) == "NVMe tier size used used% objects demotions in flight dropped"
    assert cells(lines[1]) == "server0 1.0 GiB 256.0 MiB 25.0% 170 170 3 0"
    assert cells(lines[2]) == "server1 1.0 GiB 512.0 MiB 50.0% 169 169 0 2"
    # A server without a tier: what leaves its DRAM is dropped.
    assert cells(lines[3]) == "server2 none - - - - - 5"
    # The total: the live tiers' bytes; demotions and drops from the meta's counters.
    assert cells(lines[4]) == "total 2.0 GiB 768.0 MiB 37.5% 339 339 3 7"
    assert lines[5] == (
        "dropped: 7 left DRAM with no NVMe copy (tier off or paused 5, tier short of room "
        "and not worth a disk write 2, tier full 0, put could not wait 0); demotion behind "
        "4 times, puts that waited for it 1"
    )
    assert len(lines) == 6
    # The banner leaves the reasons out.
    assert tier_lines(reply(demotions_done=339, dropped_not_demoted=7), detail=False) == lines[:5]


def test_no_tier_anywhere_is_one_line() -> None:
    r = pb.GetStatsReply(
        servers=[pb.ServerStats(server_id="server0", alive=True, capacity=256 * MiB)]
    )
    assert tier_lines(r) == [
        "NVMe tier    none: what leaves DRAM is dropped (gcache up --nvme-size SIZE; "
        "gcache-server --nvme-path DIR --nvme-size SIZE)"
    ]


def test_status_prints_the_tier_after_the_servers() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_status(reply(demotions_done=339, dropped_not_demoted=7))
    text = out.getvalue().splitlines()
    head = next(i for i, line in enumerate(text) if line.startswith("NVMe tier"))
    assert text[0].startswith("server ") and head > 3
    assert text[head + 4].startswith("total ")
