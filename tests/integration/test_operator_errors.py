"""What an operator sees when something is wrong: one line naming the key or the
port on stderr, a non-zero exit, never a traceback.

Every test starts the real console scripts (``gcache-meta``, ``gcache-server``,
``gcache``, ``gcache-bench``) as subprocesses."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gcache.cli.deploy import LocalDeployment, fetch_stats

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "deploy" / "gcache.toml"


def script(
    name: str,
    *args: str,
    env: dict[str, str] | None = None,
    stdout: int | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess[str]:
    """Run a console script of this venv with the host's GCACHE_* variables removed."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("GCACHE_")}
    full.update(env or {})
    return subprocess.run(
        [str(BIN / name), *args],
        stdout=subprocess.PIPE if stdout is None else stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=timeout,
        env=full,
        stdin=subprocess.DEVNULL,
    )


def one_line(stderr: str) -> str:
    """The stderr of a failed command: exactly one line and no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A port another process (this test) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


FREE = ["--port", "0", "--grpc-port", "0", "--metrics-port", "-1"]


# ---- refused settings: exit 2, one line naming the key ---------------------------------


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        ("[metaa]\nport = 7700\n", "[metaa]"),  # was silently ignored
        ("[meta]\nportt = 7700\n", "portt"),
        ("[meta]\nlease_ttl_s = nan\n", "lease_ttl_s"),
        ("[meta]\nput_timeout_s = inf\n", "put_timeout_s"),
        ("[meta]\nheartbeat_timeout_s = 0\n", "heartbeat_timeout_s"),
        ("[meta]\nheartbeat_timeout_s = -5.0\n", "heartbeat_timeout_s"),
        ("[meta]\nport = 65536\n", "meta.port"),
        ("[meta]\ngrpc_port = -1\n", "meta.grpc_port"),
        ("[meta]\nhigh_watermark = 1.5\n", "high_watermark"),
        ("[meta]\nlow_watermark = nan\n", "low_watermark"),
        ('[meta]\nport = "seventy"\n', "meta.port"),
        ("[meta]\nport = true\n", "meta.port"),
        ("[server]\nheartbeat_interval_s = 0\n", "heartbeat_interval_s"),  # any section
        ("[meta\nport = 1\n", "cannot read config file"),
    ],
)
def test_meta_bad_config_file_one_line(tmp_path: Path, toml: str, key: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    out = script("gcache-meta", "--config", str(path))
    assert out.returncode == 2, out.stderr
    line = one_line(out.stderr)
    assert line.startswith("gcache-meta: ") and key in line, line


@pytest.mark.parametrize(
    ("args", "env", "key"),
    [
        (["--lease-ttl-s", "nan"], {}, "lease_ttl_s"),
        (["--port", "70000"], {}, "meta.port"),
        (["--metrics-port", "-2"], {}, "metrics_port"),
        (["--high-watermark", "0.5", "--low-watermark", "0.9"], {}, "low_watermark"),
        ([], {"GCACHE_META_PUT_TIMEOUT_S": "-inf"}, "meta.put_timeout_s"),
        ([], {"GCACHE_META_PORTT": "1"}, "GCACHE_META_PORTT"),
    ],
)
def test_meta_bad_flag_or_env_one_line(args: list[str], env: dict[str, str], key: str) -> None:
    out = script("gcache-meta", *args, env=env)
    assert out.returncode == 2, out.stderr
    assert key in one_line(out.stderr)


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["--heartbeat-interval-s", "nan"], "heartbeat_interval_s"),
        (["--heartbeat-interval-s", "0"], "heartbeat_interval_s"),
        (["--capacity", "lots"], "server.capacity"),
        (["--port", "123456"], "server.port"),
        (["--meta", "127.0.0.1"], "server.meta"),
    ],
)
def test_server_bad_settings_one_line(args: list[str], key: str) -> None:
    out = script("gcache-server", *args)
    assert out.returncode == 2, out.stderr
    line = one_line(out.stderr)
    assert line.startswith("gcache-server: ") and key in line, line


def test_server_nvme_path_without_size_one_line(tmp_path: Path) -> None:
    """``--nvme-path`` without ``--nvme-size`` started a server with no NVMe tier,
    silently; now it stops it in one line that names the fix. Nothing is made."""
    nvme = tmp_path / "nvme"
    out = script("gcache-server", "--port", "0", "--nvme-path", str(nvme))
    assert out.returncode == 2, out.stderr
    line = one_line(out.stderr)
    assert line.startswith(f"gcache-server: server.nvme_path ({nvme}) needs server.nvme_size")
    assert "--nvme-size 64GiB" in line and "--nvme-size 0" in line, line
    assert not nvme.exists()


# ---- listeners: exit 1, one line naming the address and the setting -------------------


@pytest.mark.parametrize(
    ("flag", "setting"),
    [
        ("--port", "meta.port"),
        ("--grpc-port", "meta.grpc_port"),
        ("--metrics-port", "meta.metrics_port"),
    ],
)
def test_meta_port_in_use_one_line(busy_port: int, flag: str, setting: str) -> None:
    out = script("gcache-meta", "--port", "0", "--grpc-port", "0", "--metrics-port", "0",
                 flag, str(busy_port))  # fmt: skip
    assert out.returncode == 1, out.stderr
    line = one_line(out.stderr)  # gRPC's native log lines used to precede it
    assert f"127.0.0.1:{busy_port}" in line and setting in line and "in use" in line, line


def test_server_port_in_use_one_line(busy_port: int) -> None:
    out = script("gcache-server", "--port", str(busy_port), "--meta", "127.0.0.1:1")
    assert out.returncode == 1, out.stderr
    line = one_line(out.stderr)
    assert f"127.0.0.1:{busy_port}" in line and "server.port" in line, line


@pytest.mark.parametrize(
    ("host", "reason"),
    [
        ("192.0.2.1", "not an address of this host"),  # TEST-NET-1, never local
        ("nohost.invalid", "does not resolve"),
    ],
)
def test_address_not_on_this_host_one_line(host: str, reason: str) -> None:
    """deploy/gcache.toml used to ship host = 10.0.0.1: an `Errno 99` traceback."""
    for name in ("gcache-meta", "gcache-server"):
        out = script(name, "--host", host, "--port", "0")
        assert out.returncode == 1, out.stderr
        line = one_line(out.stderr)
        assert f"{host}:0" in line and reason in line, line


# ---- deploy/gcache.toml as shipped -------------------------------------------------------


def _shipped_config(tmp_path: Path) -> tuple[Path, dict[str, int]]:
    """The shipped file; if its ports are taken here, a copy with only the ports
    changed to free ones."""
    text = SHIPPED.read_text()
    ports = {k: int(v) for k, v in re.findall(r"^(\w*port) = (\d+)", text, re.M)}
    assert set(ports) == {"port", "grpc_port", "metrics_port"}
    wanted = sorted(set(ports.values()))
    busy = []
    for p in wanted:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                busy.append(p)
    if not busy:
        return SHIPPED, {"meta": ports["port"], "grpc": ports["grpc_port"]}
    remap = {p: free_port() for p in wanted}
    for old, new in remap.items():
        text = re.sub(rf"(\bport = |:){old}\b", rf"\g<1>{new}", text)
    path = tmp_path / "gcache.toml"
    path.write_text(text)
    grpc_port = remap[ports["grpc_port"]]
    return path, {"meta": remap[ports["port"]], "grpc": grpc_port}


def test_shipped_config_starts(tmp_path: Path) -> None:
    """`gcache-meta --config deploy/gcache.toml` and a `gcache-server` with the
    same file start, register and serve (the server's segment is made small and
    sparse here by flags; everything else is the file's)."""
    config, ports = _shipped_config(tmp_path)
    meta_ready, server_ready = tmp_path / "meta.ready", tmp_path / "server.ready"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GCACHE_")}
    meta = subprocess.Popen(
        [str(BIN / "gcache-meta"), "--config", str(config), "--ready-file", str(meta_ready)],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    server = None
    try:
        _wait_file(meta_ready, meta)
        server = subprocess.Popen(
            [str(BIN / "gcache-server"), "--config", str(config), "--server-id", "shipped",
             "--capacity", "64MiB", "--no-populate", "--port", "0",
             "--ready-file", str(server_ready)],
            stderr=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        _wait_file(server_ready, server)
        reply = fetch_stats(f"127.0.0.1:{ports['grpc']}")
        assert [s.server_id for s in reply.servers if s.alive] == ["shipped"]
        server.send_signal(signal.SIGTERM)
        _, err = server.communicate(timeout=20)
        assert server.returncode == 0 and "Traceback" not in err, err
    finally:
        for p in (server, meta):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
        _, err = meta.communicate(timeout=20)
        if server is not None:
            server.wait(20)
            # A clean stop keeps the segment for the next start of this server id;
            # the test's server has no next start.
            for f in Path("/dev/shm").glob(f"gcache-shipped-{server.pid}.*"):
                f.unlink()
    assert meta.returncode == 0 and "Traceback" not in err, err


def _wait_file(path: Path, proc: subprocess.Popen[str], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"exited {proc.returncode}: {proc.communicate()[1]}")
        assert time.monotonic() < deadline, f"{path} not written"
        time.sleep(0.05)


# ---- gcache (the CLI) -------------------------------------------------------------------


def test_demo_with_nothing_running_one_line() -> None:
    dead = free_port()
    out = script("gcache", "demo", "--meta", f"127.0.0.1:{dead}",
                 "--meta-grpc", f"127.0.0.1:{dead}", "--workload", "store")  # fmt: skip
    assert out.returncode == 1, out.stderr
    line = one_line(out.stderr)
    assert line.startswith("gcache demo: ") and f"127.0.0.1:{dead}" in line, line
    assert "gcache up" in line


def test_status_unreachable_one_line() -> None:
    """A gRPC error was printed as its multi-line repr."""
    dead = free_port()
    out = script("gcache", "status", "--meta-grpc", f"127.0.0.1:{dead}")
    assert out.returncode == 1, out.stderr
    line = one_line(out.stderr)
    assert f"127.0.0.1:{dead}" in line and "UNAVAILABLE" in line, line


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDeployment]:
    with LocalDeployment(tmp_path_factory.mktemp("op"), servers=1, capacity="16MiB") as d:
        yield d


@pytest.mark.parametrize("extra", [[], ["--json"]])
def test_status_into_closed_pipe_is_quiet(running: LocalDeployment, extra: list[str]) -> None:
    """`gcache status | head -0`: a reader that left is no reason for a traceback
    (BrokenPipeError)."""
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first write: every write is EPIPE
    try:
        out = script("gcache", "status", "--meta-grpc", running.meta_grpc, *extra, stdout=w)
    finally:
        os.close(w)
    assert out.returncode == 141, out.stderr
    assert out.stderr == ""


def test_status_binary_units(running: LocalDeployment) -> None:
    out = script("gcache", "status", "--meta-grpc", running.meta_grpc)
    assert out.returncode == 0, out.stderr
    assert "16.0 MiB" in out.stdout  # the capacity
    assert not re.search(r"\d (KB|MB|GB|TB)\b", out.stdout), out.stdout
    assert "tcp reads" in out.stdout and "leased to readers" in out.stdout


def test_status_says_when_there_is_no_nvme_tier(running: LocalDeployment) -> None:
    out = script("gcache", "status", "--meta-grpc", running.meta_grpc)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^NVMe tier +none: what leaves DRAM is dropped", out.stdout, re.M), out.stdout


@pytest.mark.parametrize(
    ("flag", "up_flag"),
    [
        ("--meta-port", "--meta-port"),
        ("--grpc-port", "--grpc-port"),
        ("--metrics-port", "--metrics-port"),
        ("--server-port", "--server-port"),
    ],
)
def test_up_port_in_use_one_line(tmp_path: Path, busy_port: int, flag: str, up_flag: str) -> None:
    ports = {"--meta-port": "0", "--grpc-port": "0", "--metrics-port": "0", "--server-port": "0"}
    ports[flag] = str(busy_port)
    args = [x for kv in ports.items() for x in kv]
    out = script("gcache", "up", "--servers", "1", "--capacity", "16MiB",
                 "--data-dir", str(tmp_path), *args)  # fmt: skip
    assert out.returncode == 1, out.stderr
    line = one_line(out.stderr)
    assert f"127.0.0.1:{busy_port}" in line and up_flag in line and "in use" in line, line
    assert "Traceback" not in out.stdout


def test_up_ports_from_environment(tmp_path: Path) -> None:
    """`gcache up` takes its ports from GCACHE_META_PORT & co. (documented for
    `make run`), and a bad one is refused naming the variable."""
    out = script("gcache", "up", "--data-dir", str(tmp_path),
                 env={"GCACHE_META_GRPC_PORT": "99999"})  # fmt: skip
    assert out.returncode == 2
    assert "meta.grpc_port" in one_line(out.stderr)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        port = busy.getsockname()[1]
        out = script("gcache", "up", "--servers", "1", "--capacity", "16MiB",
                     "--data-dir", str(tmp_path), "--meta-port", "0", "--metrics-port", "0",
                     "--server-port", "0", env={"GCACHE_META_GRPC_PORT": str(port)})  # fmt: skip
    finally:
        busy.close()
    assert out.returncode == 1
    assert f"127.0.0.1:{port}" in one_line(out.stderr)


def test_up_interrupted_while_starting(tmp_path: Path) -> None:
    """Ctrl-C while `gcache up` waits for its daemons: one line, every process it
    started is gone, no traceback."""
    proc = subprocess.Popen(
        [str(BIN / "gcache"), "up", "--servers", "2", "--capacity", "16MiB",
         "--data-dir", str(tmp_path), "--meta-port", "0", "--grpc-port", "0",
         "--metrics-port", "0", "--server-port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not (tmp_path / "meta.log").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode in (130, 0), (out, err)
    assert "Traceback" not in err + out
    if proc.returncode == 130:
        assert "interrupted while starting" in one_line(err)
    leftover = subprocess.run(
        ["pgrep", "-f", f"--ready-file {tmp_path}/"], capture_output=True, text=True
    )
    assert leftover.stdout == "", leftover.stdout


# ---- gcache-bench ------------------------------------------------------------------------


def test_bench_dead_meta_one_line() -> None:
    dead = free_port()
    out = script("gcache-bench", "write", "-s", "4K", "-n", "1", "--meta", f"127.0.0.1:{dead}")
    assert out.returncode == 1
    line = one_line(out.stderr)
    assert f"127.0.0.1:{dead}" in line, line


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["write", "-s", "lots"], "not a size"),
        (["write", "--meta", "nohost"], "--meta"),
        (["write", "--meta", "h:x"], "--meta"),
    ],
)
def test_bench_bad_arguments_one_line(args: list[str], needle: str) -> None:
    out = script("gcache-bench", *args)
    assert out.returncode != 0
    assert needle in one_line(out.stderr)


def test_bench_interrupted_one_line(tmp_path: Path) -> None:
    """Ctrl-C during a `gcache-bench --local` run: one line, exit 130, the local
    deployment it started is stopped (a KeyboardInterrupt traceback before)."""
    proc = subprocess.Popen(
        [str(BIN / "gcache-bench"), "write", "-s", "4K", "-D", "60", "--local"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    header = proc.stdout.readline()  # printed once the deployment is up
    assert header.startswith("# gcache-bench write"), header
    meta = header.split("meta ")[-1].strip()
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert one_line(err) == "gcache-bench: interrupted"
    left = subprocess.run(["pgrep", "-f", "gcache-bench-"], capture_output=True, text=True)
    for pid in left.stdout.split():  # other benchmarks may run; none may use our meta
        assert meta.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()


def test_bench_json_into_missing_folder_refused_first() -> None:
    out = script("gcache-bench", "write", "-s", "4K", "--json", "/nonexistent/dir/w.json")
    assert out.returncode != 0
    assert "--json" in one_line(out.stderr)
    assert out.stdout == ""  # refused before anything ran


@pytest.mark.parametrize(
    ("args", "code", "needle"),
    [
        (["--capacity", "lots"], 2, "server.capacity"),
        (["--servers", "0"], 2, "--servers"),
        (["--server-port", "65535", "--servers", "2"], 2, "server.port"),
        (["--data-dir", "/proc/gcache-no"], 1, "/proc/gcache-no"),
    ],
)
def test_up_refuses_before_starting_one_line(args: list[str], code: int, needle: str) -> None:
    base = ["--meta-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--server-port", "0"]
    out = script("gcache", "up", *base, *args)
    assert out.returncode == code, out.stderr
    assert needle in one_line(out.stderr)


@pytest.mark.parametrize(
    ("name", "args", "needle"),
    [
        ("gcache-meta", ["--portt", "1"], "--portt"),
        ("gcache-server", ["--populate=maybe"], "--populate"),
        ("gcache", ["up", "--servers", "x"], "--servers"),
        ("gcache", ["nope"], "nope"),
        ("gcache-bench", ["nope"], "nope"),
    ],
)
def test_bad_arguments_one_line(name: str, args: list[str], needle: str) -> None:
    """argparse printed its whole usage text (many lines) before the message."""
    out = script(name, *args)
    assert out.returncode == 2
    line = one_line(out.stderr)
    assert needle in line and "--help" in line, line
