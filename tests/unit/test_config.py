"""Typed settings (gcache.config): sizes, precedence, validation, argparse."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from gcache.config import (
    ClientConfig,
    MetaConfig,
    ServerConfig,
    add_arguments,
    from_args,
    load,
    parse_size,
)
from gcache.errors import ConfigError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """from_args and load(env=None) read os.environ: keep the host's GCACHE_* out."""
    import os

    for key in list(os.environ):
        if key.startswith("GCACHE_"):
            monkeypatch.delenv(key)


def _toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "gcache.toml"
    path.write_text(text)
    return str(path)


# ---- parse_size --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4096", 4096),
        (4096, 4096),
        (0, 0),
        ("0", 0),
        ("64MiB", 64 * 1024 * 1024),
        ("1GB", 1_000_000_000),
        ("1.5KiB", 1536),
        ("1KiB", 1024),
        ("2kib", 2048),
        ("1k", 1024),  # a bare letter is binary, as dd, fio and perftest users expect
        ("1M", 2**20),
        ("1m", 2**20),
        ("64M", 64 * 2**20),
        ("2G", 2 * 2**30),
        ("1T", 2**40),
        ("1P", 2**50),
        ("1PiB", 2**50),
        ("1PB", 10**15),
        ("1MB", 10**6),
        ("1.5K", 1536),
        ("3KB", 3000),
        ("10b", 10),
        ("10B", 10),
        ("1GiB", 2**30),
        ("2TiB", 2 * 2**40),
        ("1TB", 10**12),
        ("1Gi", 2**30),
        (" 12 MB ", 12_000_000),
        ("0.5MiB", 512 * 1024),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", " ", "abc", "MiB", "-5", "1e3", "1_000", "12 XB", "1EiB", "1..5k", "4 4", "0x10"]
)
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)


@pytest.mark.parametrize("text", ["5iB", "5i", "7ib"])
def test_parse_size_prefixless_binary_unit(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_size(text)


# ---- load: defaults < file < env < overrides ------------------------------------------


def test_defaults() -> None:
    assert load(MetaConfig, env={}) == MetaConfig()
    assert load(ServerConfig, env={}) == ServerConfig()
    assert load(ClientConfig, env={}) == ClientConfig()
    cfg = MetaConfig()
    assert (cfg.port, cfg.grpc_port, cfg.high_watermark, cfg.low_watermark) == (
        7700,
        7701,
        0.90,
        0.80,
    )


def test_precedence(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        "[meta]\nport = 1111\ngrpc_port = 1112\nlease_ttl_s = 3.5\n[server]\nport = 9999\n",
    )
    file_only = load(MetaConfig, path, env={})
    assert (file_only.port, file_only.grpc_port, file_only.lease_ttl_s) == (1111, 1112, 3.5)
    assert file_only.host == "127.0.0.1"  # untouched default

    env = {"GCACHE_META_PORT": "2222", "GCACHE_SERVER_PORT": "1", "HOME": "/x"}
    with_env = load(MetaConfig, path, env=env)
    assert (with_env.port, with_env.grpc_port) == (2222, 1112)
    assert isinstance(with_env.port, int)

    top = load(MetaConfig, path, env=env, overrides={"port": "3333", "grpc_port": None})
    assert (top.port, top.grpc_port) == (3333, 1112)  # None does not override

    server = load(ServerConfig, path, env=env)
    assert server.port == 1  # env beats the [server] section


def test_env_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GCACHE_META_PORT", "4321")
    monkeypatch.setenv("GCACHE_META_HIGH_WATERMARK", "0.95")
    cfg = load(MetaConfig)
    assert cfg.port == 4321 and cfg.high_watermark == 0.95


def test_env_types() -> None:
    cfg = load(
        ServerConfig,
        env={
            "GCACHE_SERVER_POPULATE": "yes",
            "GCACHE_SERVER_HEARTBEAT_INTERVAL_S": "0.25",
            "GCACHE_SERVER_CAPACITY": "2GiB",
        },
    )
    assert cfg.populate is True
    assert cfg.heartbeat_interval_s == 0.25
    assert cfg.capacity_bytes == 2 * 2**30
    for text in ("1", "true", "TRUE", "on"):
        assert load(ServerConfig, env={"GCACHE_SERVER_POPULATE": text}).populate is True
    for text in ("0", "false", "off", "no"):
        assert load(ServerConfig, env={"GCACHE_SERVER_POPULATE": text}).populate is False


def test_file_bool(tmp_path: Path) -> None:
    assert load(ServerConfig, _toml(tmp_path, "[server]\npopulate = true\n"), env={}).populate


def test_unknown_file_key(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope"):
        load(MetaConfig, _toml(tmp_path, "[meta]\nnope = 1\n"), env={})


def test_unknown_env_var() -> None:
    with pytest.raises(ConfigError, match="GCACHE_META_NOPE"):
        load(MetaConfig, env={"GCACHE_META_NOPE": "1"})
    # other sections' variables are not this section's business
    assert load(MetaConfig, env={"GCACHE_CLIENT_NOPE": "1"}) == MetaConfig()


def test_missing_or_bad_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load(MetaConfig, str(tmp_path / "absent.toml"), env={})
    with pytest.raises(ConfigError):
        load(MetaConfig, _toml(tmp_path, "[meta\nport = "), env={})


@pytest.mark.parametrize(
    ("cls", "toml", "env"),
    [
        (MetaConfig, '[meta]\nport = "abc"\n', {}),
        (MetaConfig, "[meta]\nport = [1, 2]\n", {}),
        (MetaConfig, "[meta]\nlow_watermark = {a = 1}\n", {}),
        (MetaConfig, "", {"GCACHE_META_PORT": "7.5.1"}),
        (MetaConfig, "", {"GCACHE_META_PORT": ""}),
        (MetaConfig, "", {"GCACHE_META_LOW_WATERMARK": "high"}),
        (ClientConfig, "", {"GCACHE_CLIENT_LAYERS_IN_FLIGHT": "four"}),
    ],
)
def test_bad_types(tmp_path: Path, cls: type, toml: str, env: dict[str, str]) -> None:
    path = _toml(tmp_path, toml) if toml else None
    with pytest.raises(ConfigError):
        load(cls, path, env=env)


def test_bad_override_type() -> None:
    with pytest.raises(ConfigError):
        load(MetaConfig, env={}, overrides={"port": "x"})


@pytest.mark.parametrize(
    ("cls", "toml", "env"),
    [
        (MetaConfig, "[meta]\nport = true\n", {}),
        (MetaConfig, "[meta]\nport = 7.9\n", {}),
        (ServerConfig, "[server]\npopulate = 5\n", {}),
        (ServerConfig, "", {"GCACHE_SERVER_POPULATE": "ture"}),
    ],
)
def test_lossy_coercions_rejected(
    tmp_path: Path, cls: type, toml: str, env: dict[str, str]
) -> None:
    path = _toml(tmp_path, toml) if toml else None
    with pytest.raises(ConfigError):
        load(cls, path, env=env)


def test_unknown_override_key() -> None:
    with pytest.raises(ConfigError):
        load(MetaConfig, env={}, overrides={"nope": 1})


# ---- checks ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"low_watermark": 0.9, "high_watermark": 0.9},
        {"low_watermark": 0.95, "high_watermark": 0.9},
        {"low_watermark": 0.0, "high_watermark": 0.5},
        {"low_watermark": -0.1},
        {"low_watermark": 0.5, "high_watermark": 1.01},
        {"eviction_policy": "fifo"},
        {"lease_ttl_s": 0.0},
        {"lease_ttl_s": 1.0},  # grants end 1 s before the lease: nothing left
        {"put_timeout_s": 0.5},
        {"put_timeout_s": -1.0},
        {"heartbeat_timeout_s": 0.0},
    ],
)
def test_meta_check_rejects(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        MetaConfig(**kw).check()  # type: ignore[arg-type]
    overrides = {k: str(v) for k, v in kw.items()}
    with pytest.raises(ConfigError):
        load(MetaConfig, env={}, overrides=overrides)


def test_meta_check_accepts_edges() -> None:
    MetaConfig(low_watermark=0.01, high_watermark=1.0).check()
    MetaConfig(low_watermark=0.5, high_watermark=0.51).check()
    cfg = load(
        MetaConfig, env={"GCACHE_META_LOW_WATERMARK": "0.1", "GCACHE_META_HIGH_WATERMARK": "1"}
    )
    assert (cfg.low_watermark, cfg.high_watermark) == (0.1, 1.0)


def test_server_and_client_checks() -> None:
    with pytest.raises(ConfigError):
        ServerConfig(capacity="1MB").check()  # 10**6 < 2**20: MB is decimal
    ServerConfig(capacity="1M").check()  # 1M is 1MiB
    ServerConfig(capacity="1MiB").check()
    with pytest.raises(ConfigError):
        ServerConfig(capacity="lots").check()
    with pytest.raises(ConfigError):
        ServerConfig(meta="localhost").check()
    with pytest.raises(ConfigError):
        ClientConfig(layers_in_flight=0).check()
    with pytest.raises(ConfigError):
        ClientConfig(max_inflight_writes=0).check()


def test_nvme_path_without_nvme_size_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """``--nvme-path`` alone used to start the server with no tier, silently: now it
    stops it with one line that says what to add. ``--nvme-size 0`` says so on
    purpose: no tier, the path unused."""
    want = "server.nvme_path (/nvme/gcache) needs server.nvme_size"
    fix = "--nvme-size 64GiB), or --nvme-size 0"
    errors = []
    for how in (
        lambda: ServerConfig(nvme_path="/nvme/gcache").check(),
        lambda: load(ServerConfig, env={"GCACHE_SERVER_NVME_PATH": "/nvme/gcache"}),
        lambda: load(ServerConfig, env={}, overrides={"nvme_path": "/nvme/gcache"}),
        # Every daemon checks every section of its file: the meta refuses it too.
        lambda: load(MetaConfig, _toml(tmp_path, '[server]\nnvme_path = "/nvme/gcache"\n')),
    ):
        with pytest.raises(ConfigError) as info:
            how()
        errors.append(str(info.value))
    for text in errors:
        assert want in text and fix in text and "\n" not in text, text
    off = load(ServerConfig, env={}, overrides={"nvme_path": "/nvme/gcache", "nvme_size": "0"})
    assert off.nvme_size_bytes == 0
    on = load(ServerConfig, env={}, overrides={"nvme_path": "/nvme/gcache", "nvme_size": "2G"})
    assert on.nvme_size_bytes == 2 << 30
    assert ServerConfig().nvme_size_bytes == 0 and ServerConfig().nvme_path == ""
    with pytest.raises(ConfigError, match=r"needs server\.nvme_path"):
        ServerConfig(nvme_size="2G").check()


def test_configs_are_frozen() -> None:
    cfg = MetaConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1  # type: ignore[misc]


# ---- argparse ----------------------------------------------------------------------


def _parser(cls: type) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="t")
    add_arguments(parser, cls)
    return parser


def test_every_field_has_a_flag_with_default_in_help() -> None:
    for cls in (MetaConfig, ServerConfig, ClientConfig):
        text = _parser(cls).format_help()
        assert "--config" in text
        for f in dataclasses.fields(cls):
            assert "--" + f.name.replace("_", "-") in text
    text = _parser(MetaConfig).format_help()
    assert "(default: 7700)" in text


def test_from_args_unset_flags_keep_defaults() -> None:
    args = _parser(MetaConfig).parse_args([])
    assert all(getattr(args, f.name) is None for f in dataclasses.fields(MetaConfig))
    assert from_args(MetaConfig, args) == MetaConfig()


def test_from_args_flags_converted() -> None:
    args = _parser(MetaConfig).parse_args(
        ["--port", "9000", "--low-watermark", "0.5", "--ready-file", "/tmp/r"]
    )
    cfg = from_args(MetaConfig, args)
    assert cfg.port == 9000 and isinstance(cfg.port, int)
    assert cfg.low_watermark == 0.5
    assert cfg.ready_file == "/tmp/r"


def test_from_args_bool_flag() -> None:
    assert from_args(ServerConfig, _parser(ServerConfig).parse_args(["--populate"])).populate
    assert not from_args(ServerConfig, _parser(ServerConfig).parse_args(["--no-populate"])).populate
    assert from_args(ServerConfig, _parser(ServerConfig).parse_args([])).populate  # the default


def test_from_args_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _toml(tmp_path, "[meta]\nport = 1111\ngrpc_port = 1112\nlease_ttl_s = 2.0\n")
    monkeypatch.setenv("GCACHE_META_GRPC_PORT", "2222")
    args = _parser(MetaConfig).parse_args(["--config", path, "--lease-ttl-s", "4"])
    cfg = from_args(MetaConfig, args)
    assert (cfg.port, cfg.grpc_port, cfg.lease_ttl_s) == (1111, 2222, 4.0)


def test_from_args_bad_value() -> None:
    args = _parser(MetaConfig).parse_args(["--port", "seventy"])
    with pytest.raises(ConfigError):
        from_args(MetaConfig, args)
    args = _parser(MetaConfig).parse_args(["--high-watermark", "0.5"])
    with pytest.raises(ConfigError):  # below the default low watermark
        from_args(MetaConfig, args)


# ---- refused at start with one line naming the key --------------------------


def test_size_one_letter_units_are_binary() -> None:
    """`-s 1M` was 1,000,000 bytes; it is 1 MiB now, and P/PB/PiB are accepted."""
    assert parse_size("1M") == parse_size("1MiB") == 1 << 20
    assert parse_size("1P") == parse_size("1PiB") == 1 << 50
    assert parse_size("1PB") == 10**15
    assert parse_size(10**18) == 10**18
    for bad in (-1, True, 1.5):
        with pytest.raises(ConfigError):
            parse_size(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("cls", "key", "value"),
    [
        (MetaConfig, "lease_ttl_s", "nan"),
        (MetaConfig, "lease_ttl_s", "inf"),
        (MetaConfig, "put_timeout_s", "-inf"),
        (MetaConfig, "heartbeat_timeout_s", "nan"),
        (MetaConfig, "heartbeat_timeout_s", "0"),
        (MetaConfig, "heartbeat_timeout_s", "-3"),
        (MetaConfig, "high_watermark", "nan"),
        (MetaConfig, "low_watermark", "nan"),
        (MetaConfig, "high_watermark", "1.5"),
        (MetaConfig, "port", "65536"),
        (MetaConfig, "port", "-1"),
        (MetaConfig, "grpc_port", "70000"),
        (MetaConfig, "grpc_port", "-1"),
        (MetaConfig, "metrics_port", "-2"),
        (MetaConfig, "metrics_port", "65536"),
        (MetaConfig, "max_keys_per_request", "0"),
        (MetaConfig, "checkpoint_interval", "-1"),
        (ServerConfig, "heartbeat_interval_s", "0"),
        (ServerConfig, "heartbeat_interval_s", "nan"),
        (ServerConfig, "heartbeat_interval_s", "inf"),
        (ServerConfig, "port", "99999"),
        (ServerConfig, "meta", "127.0.0.1:0"),
        (ServerConfig, "meta", "127.0.0.1:77011"),
        (ServerConfig, "meta", ":7701"),
        (ServerConfig, "capacity", "lots"),
        (ClientConfig, "timeout_s", "nan"),
        (ClientConfig, "timeout_s", "0"),
        (ClientConfig, "meta", "localhost"),
        (ClientConfig, "meta_grpc", "h:x"),
    ],
)
def test_bad_values_refused_naming_the_key(cls: type, key: str, value: str) -> None:
    """NaN, infinite, zero or negative timeouts/intervals, ports outside 0..65535 and
    watermarks outside (0, 1] are refused from every source, naming the key."""
    with pytest.raises(ConfigError, match=rf"\b{key}\b") as info:
        load(cls, env={}, overrides={key: value})
    assert "\n" not in str(info.value)
    section = {MetaConfig: "META", ServerConfig: "SERVER", ClientConfig: "CLIENT"}[cls]
    with pytest.raises(ConfigError, match=rf"\b{key}\b"):
        load(cls, env={f"GCACHE_{section}_{key.upper()}": value})


@pytest.mark.parametrize("literal", ["nan", "inf", "-inf", "0.0", "-1.0"])
def test_toml_float_literals_refused(tmp_path: Path, literal: str) -> None:
    """TOML has nan and inf literals; a timeout of nan used to pass check()."""
    path = _toml(tmp_path, f"[meta]\nlease_ttl_s = {literal}\n")
    with pytest.raises(ConfigError, match="lease_ttl_s"):
        load(MetaConfig, path, env={})


def test_ports_zero_and_metrics_off_allowed() -> None:
    cfg = load(MetaConfig, env={}, overrides={"port": 0, "grpc_port": 0, "metrics_port": -1})
    assert (cfg.port, cfg.grpc_port, cfg.metrics_port) == (0, 0, -1)
    assert load(ServerConfig, env={}, overrides={"port": "65535"}).port == 65535


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[metaa]\nport = 1\n", "[metaa]"),
        ("[meta]\nport = 1\n[sever]\nport = 2\n", "[sever]"),
        ("port = 7700\n", "[port]"),
        ("meta = 5\n", "meta"),
        ("[server]\nportt = 1\n", "portt"),  # a typo in another section is refused too
        ("[server]\nheartbeat_interval_s = 0\n", "server.heartbeat_interval_s"),
        ("[client]\ntimeout_s = nan\n", "client.timeout_s"),
        ("[meta]\nhost = [1]\n", "meta.host"),
        ('[meta]\nport = "7700x"\n', "meta.port"),
    ],
)
def test_unknown_sections_and_keys_refused(tmp_path: Path, text: str, needle: str) -> None:
    """`[metaa]` was silently ignored: every section and key of the file is checked."""
    path = _toml(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load(MetaConfig, path, env={})
    assert needle in str(info.value) and path in str(info.value)


def test_shipped_config_loads() -> None:
    """deploy/gcache.toml as shipped passes every check, for every section."""
    path = str(Path(__file__).resolve().parents[2] / "deploy" / "gcache.toml")
    meta = load(MetaConfig, path, env={})
    server = load(ServerConfig, path, env={})
    assert meta.port == 7700 and server.meta == f"{meta.host}:{meta.grpc_port}"


def test_config_errors_are_one_line() -> None:
    for kw in ({"low_watermark": "0.95"}, {"lease_ttl_s": "1"}, {"eviction_policy": "x"}):
        with pytest.raises(ConfigError) as info:
            load(MetaConfig, env={}, overrides=kw)
        assert next(iter(kw)) in str(info.value) and "\n" not in str(info.value)


def test_secret_values_never_echoed(tmp_path: Path) -> None:
    """A token of the wrong type is refused naming the key, not showing the value."""
    path = _toml(tmp_path, '[client]\ntoken = ["s3cret-token"]\n')
    with pytest.raises(ConfigError, match=r"client\.token") as info:
        load(ClientConfig, path, env={})
    assert "s3cret" not in str(info.value)
    with pytest.raises(ConfigError, match=r"meta\.port") as info:
        load(MetaConfig, env={}, overrides={"port": "s3cret"})
    assert "s3cret" in str(info.value)  # ordinary values are shown


def test_bench_size_argument_follows_the_size_rule() -> None:
    """`gcache-bench -s 1M` was refused as 1,000,000 bytes (not a multiple of 1 KiB)."""
    from gcache.benchtool.main import build_parser, check_args

    def sizes(*argv: str) -> list[int]:
        return check_args(build_parser().parse_args(list(argv)))

    assert sizes("write", "-s", "1M") == [1 << 20]
    assert sizes("write", "-s", "64k") == [64 << 10]
    assert sizes("read", "-s", "1MiB") == [1 << 20]
    assert "1M = 1MiB" in " ".join(build_parser().format_help().split())
