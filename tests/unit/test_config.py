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
        ("1k", 1000),
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
    "text", ["", " ", "abc", "MiB", "-5", "1e3", "1_000", "12 XB", "1PiB", "1..5k", "4 4", "0x10"]
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
        ServerConfig(capacity="1MB").check()  # 10**6 < 2**20
    ServerConfig(capacity="1MiB").check()
    with pytest.raises(ConfigError):
        ServerConfig(capacity="lots").check()
    with pytest.raises(ConfigError):
        ServerConfig(meta="localhost").check()
    with pytest.raises(ConfigError):
        ClientConfig(layers_in_flight=0).check()
    with pytest.raises(ConfigError):
        ClientConfig(max_inflight_writes=0).check()


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
