"""The trace replayer: trace parsing and errors, accounting, the references, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gcache.cli.main import main
from gcache.layout import Layout, preset
from gcache.meta.eviction import compute_for_layout
from gcache.replay.belady import NEVER, Oracle
from gcache.replay.runner import Options, replay, sweep
from gcache.replay.trace import TraceError, load

GB = 10**9


def write(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def rec(ts: int, length: int, ids: list[int]) -> dict[str, object]:
    return {"timestamp": ts, "input_length": length, "output_length": 10, "hash_ids": ids}


def conversation() -> list[dict[str, object]]:
    """Two conversations of three turns each; a turn re-sends the previous prompt
    (whose partial last trace block becomes a new id) and adds to it."""
    out = []
    for c in range(2):
        base = 1000 * c
        ids: list[int] = []
        for turn in range(3):
            full = [base + i for i in range(3 * turn + 2)]
            ids = [*full, base + 500 + turn]
            out.append(rec(10_000 * turn + c, 512 * len(full) + 200, ids))
    return sorted(out, key=lambda r: r["timestamp"])  # type: ignore[arg-type, return-value]


def test_trace_keys_follow_hash_ids(tmp_path: Path) -> None:
    t = load(write(tmp_path / "t.jsonl", [rec(0, 1100, [7, 8, 9]), rec(5, 600, [7, 3])]), 64)
    assert t.requests == 2 and t.times == [0.0, 0.005]
    assert [len(k) for k in t.keys] == [1100 // 64, 600 // 64]
    assert t.keys[0][:8] == t.keys[1][:8]  # same first trace block, same 8 keys
    assert t.keys[0][8] != t.keys[1][8]
    assert all(len(k) == 16 for k in t.keys[0])
    assert len(set(t.keys[0])) == len(t.keys[0])


@pytest.mark.parametrize(
    ("line", "msg"),
    [
        ("not json", "malformed record"),
        ('{"timestamp": 0, "input_length": 10}', "malformed record"),
        (
            '{"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": [1]}',
            "input_length",
        ),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}', ">= 0"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "> 0"),
        ('{"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ],
)
def test_malformed_lines_name_their_line(tmp_path: Path, line: str, msg: str) -> None:
    good = json.dumps(rec(0, 10, [1]))
    p = tmp_path / "bad.jsonl"
    p.write_text(f"{good}\n{good}\n{line}\n")
    with pytest.raises(TraceError, match=rf"bad.jsonl:3: .*{msg}"):
        load(p, 64)


def test_time_going_back_and_empty_traces_are_errors(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=":2: timestamp"):
        load(write(tmp_path / "t.jsonl", [rec(5, 10, [1]), rec(4, 10, [2])]), 64)
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        load(tmp_path / "e.jsonl", 64)
    with pytest.raises(TraceError, match="cannot open"):
        load(tmp_path / "missing.jsonl", 64)
    with pytest.raises(TraceError, match="divide"):
        load(tmp_path / "e.jsonl", 100)


def test_references_and_checkpoints_on_a_conversation(tmp_path: Path) -> None:
    trace = load(write(tmp_path / "c.jsonl", conversation()), 64)
    rows = {
        r["policy"]: r
        for r in sweep(
            trace, ["naive", "strict", "lru", "cost", "belady"], [100 * GB], Options(), jobs=1
        )
    }
    # Turns continue at 512-token boundaries inside the previous prompt: without a
    # window there strict O(W) reuses nothing; the checkpoint rule puts one there.
    assert rows["strict"]["flops_saved"] == 0
    assert rows["naive"]["flops_saved"] > 0
    for p in ("lru", "cost", "belady"):
        assert rows[p]["flops_saved"] == pytest.approx(rows["naive"]["flops_saved"])
        assert rows[p]["checkpoints_saved"] > 0
        assert rows[p]["swa_vs_required"] <= 1.05
        assert rows[p]["bytes_stored"] < rows["naive"]["bytes_stored"] / 2
    # The FLOPs figure is the model's: saved = sum F(hit) / sum F(prompt).
    compute = compute_for_layout(Layout(preset("mimo-v2-flash", 64)))
    assert rows["naive"]["flops_total"] == pytest.approx(
        sum(compute.prefix(n) for n in trace.lengths)
    )
    for key in (
        "policy",
        "capacity_bytes",
        "token_hit_rate",
        "flops_saved",
        "bytes_stored",
        "swa_bytes_stored",
        "blocks_per_s",
    ):
        assert key in rows["lru"]


def test_small_capacity_gcache_beats_naive(tmp_path: Path) -> None:
    trace = load(write(tmp_path / "c.jsonl", conversation()), 64)
    cap = 400 * 10**6  # fits ~28 naive blocks: less than one conversation
    naive = replay(trace, "naive", cap, Options())
    lru = replay(trace, "lru", cap, Options())
    assert naive["objects_evicted"] > 0
    assert lru["flops_saved"] > naive["flops_saved"]


def test_belady_oracle() -> None:
    class T:
        block_size = 64
        keys = [[b"a", b"b", b"c"], [b"a", b"b", b"x"], [b"a", b"b", b"c", b"d"]]
        lengths = [64 * 3 + 1, 64 * 3 + 1, 64 * 4 + 1]

    o = Oracle(T(), tail=2)  # type: ignore[arg-type]
    assert o.shared == [0, 2, 3]
    assert o.next_use(b"a", False, 0) == 1.0
    assert o.next_use(b"a", False, 1) == 2.0
    assert o.next_use(b"a", False, 2) == NEVER
    assert o.next_use(b"c", True, 0) == 2.0  # the window of request 2 ends after c
    assert o.next_use(b"x", False, 0) == NEVER


def test_cli_replay(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write(tmp_path / "c.jsonl", conversation())
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    with pytest.raises(SystemExit) as e:
        main(
            [
                "replay",
                "--trace",
                str(trace),
                "--capacity",
                "400MB,100GB",
                "--policy",
                "naive,lru,cost",
                "--jobs",
                "1",
                "--json",
                str(out_json),
                "--plot",
                str(out_png),
            ]
        )
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "FLOPs saved" in text and "| 100 GB" in text
    rows = json.loads(out_json.read_text())
    assert {r["policy"] for r in rows} == {"naive", "lru", "cost"} and len(rows) == 6
    assert out_png.read_bytes()[:4] == b"\x89PNG"


def test_cli_reports_a_bad_line_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(rec(0, 10, [1])) + "\n{oops\n")
    with pytest.raises(SystemExit) as e:
        main(["replay", "--trace", str(p), "--capacity", "1GB", "--jobs", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:2" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as e:
        main(["replay", "--trace", str(p), "--policy", "fifo"])
    assert e.value.code == 2
