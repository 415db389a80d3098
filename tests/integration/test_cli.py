"""`gcache up`, `gcache status`, `--help`: the commands an operator types."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gcache.cli.deploy import fetch_stats


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    "module", ["gcache.cli.main", "gcache.meta.daemon", "gcache.server.daemon"]
)
def test_help_lists_settings(module: str) -> None:
    out = run(module, "--help")
    assert out.returncode == 0
    assert "usage:" in out.stdout
    if module != "gcache.cli.main":
        assert "--config" in out.stdout and "default:" in out.stdout


def test_bad_settings_are_rejected_clearly(tmp_path: Path) -> None:
    out = run("gcache.meta.daemon", "--high-watermark", "0.5", "--low-watermark", "0.9")
    assert out.returncode == 2 and "low_watermark" in out.stderr
    out = run("gcache.server.daemon", "--capacity", "lots")
    assert out.returncode == 2 and "not a size" in out.stderr
    cfg = tmp_path / "gcache.toml"
    cfg.write_text("[meta]\nportt = 1\n")
    out = run("gcache.meta.daemon", "--config", str(cfg))
    assert out.returncode == 2 and "unknown setting" in out.stderr


def test_up_demo_status_and_clean_stop(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gcache.cli.main",
            "up",
            "--data-dir",
            str(tmp_path),
            "--meta-port",
            "0",
            "--grpc-port",
            "0",
            "--metrics-port",
            "0",
            "--server-port",
            "0",
            "--capacity",
            "256MiB",
            "--demo",
            "--demo-conversations",
            "1",
            "--demo-turns",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "serving; Ctrl-C to stop" in line:
                break
        text = "".join(lines)
        assert "serving; Ctrl-C to stop" in text, text
        assert "mismatches: 0" in text
        # The model workload ran and every turn's logits matched a cold recompute.
        assert re.search(r"exact logits\s+2 of 2 turns", text), text
        assert re.search(r"reused from GCache [1-9]", text), text
        grpc_addr = re.search(r"meta gRPC\s+(\S+)", text)
        assert grpc_addr is not None
        reply = fetch_stats(grpc_addr.group(1))
        assert sum(s.alive for s in reply.servers) == 2
        assert dict(reply.counters)["hit_blocks"] > 0
        st = run("gcache.cli.main", "status", "--meta-grpc", grpc_addr.group(1))
        assert st.returncode == 0 and "server0" in st.stdout and "lookups" in st.stdout
        # one unit system (binary) in status and the demo summary
        assert "256.0 MiB" in st.stdout and "tcp reads" in st.stdout, st.stdout
        # reads over shared memory never reach a server: the meta counts what it leased
        leased = re.search(r"leased to readers \(TCP and shared memory\): (\d+) objects", st.stdout)
        assert leased is not None and int(leased.group(1)) > 0, st.stdout
        assert not re.search(r"\d (KB|MB|GB|TB)\b", st.stdout), st.stdout
        assert re.search(r"bytes read\s+[\d.]+ MiB at [\d.]+ GiB/s", text), text
        pids = _our_server_pids(tmp_path)
        assert len(pids) == 2, pids
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:  # a failed assertion: let `gcache up` stop its daemons
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    assert proc.returncode == 0, rest
    assert "stopped: server0=0, server1=0, meta=0" in rest
    for pid in pids:
        assert not Path(f"/dev/shm/gcache-server0-{pid}.seg").exists()
        assert not Path(f"/dev/shm/gcache-server1-{pid}.seg").exists()
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def _our_server_pids(tmp_path: Path) -> list[int]:
    """Pids of the segment files of this test's servers (other tests, run
    concurrently, have their own)."""
    pids = [
        int(p) for p in re.findall(r"gcache-server\d-(\d+)\.seg", " ".join(os.listdir("/dev/shm")))
    ]
    ours = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(tmp_path).encode() in cmdline:
            ours.append(pid)
    return ours


def test_up_help_documents_ports_and_sizes() -> None:
    out = run("gcache.cli.main", "up", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for name in ("$GCACHE_META_PORT", "$GCACHE_META_GRPC_PORT", "$GCACHE_SERVER_PORT"):
        assert name in text
    assert "1G = 1GiB" in text


def test_bench_help_documents_size_units() -> None:
    out = run("gcache.benchtool.main", "--help")
    assert out.returncode == 0 and "1M = 1MiB" in " ".join(out.stdout.split())
