"""gcache-bench argument handling: what it runs, and the clear errors it gives."""

from __future__ import annotations

import pytest

from gcache.benchtool.main import SWEEP, build_parser, check_args


def sizes(*argv: str) -> list[int]:
    return check_args(build_parser().parse_args(list(argv)))


def refused(*argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        sizes(*argv)
    return str(exc.value)


def test_sizes_and_sweep() -> None:
    assert sizes("write") == [65536]
    assert sizes("read", "-s", "1MiB") == [1 << 20]
    assert sizes("read", "-s", "4096") == [4096]
    assert sizes("write", "-a") == SWEEP
    assert SWEEP[0] == 4096 and SWEEP[-1] == 64 << 20 and len(SWEEP) == 15


def test_prompts_for_layer_and_lookup_modes() -> None:
    assert sizes("get_layers") == [32768]
    assert sizes("lookup") == [4096, 32768, 131072]
    assert sizes("lookup", "--prompt", "4096,32768,131072") == [4096, 32768, 131072]


def test_defaults() -> None:
    a = build_parser().parse_args(["write"])
    assert (a.qd, a.clients, a.transport, a.preset, a.compute) == (
        1,
        1,
        "tcp",
        "mimo-v2-flash",
        "sleep",
    )
    assert a.index_blocks == 1_000_000 and not a.local and a.meta is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("write", "--qd", "0"), "--qd, --clients and --batch must be >= 1"),
        (("write", "--clients", "0"), "--qd, --clients and --batch must be >= 1"),
        (("read", "--batch", "0"), "--qd, --clients and --batch must be >= 1"),
        (("write", "-n", "0"), "-n must be >= 1"),
        (("read", "-D", "0"), "-D must be > 0"),
        (("write", "-s", "lots"), "gcache-bench:"),
        (("write", "-s", "0"), "gcache-bench:"),
        (("get_layers", "-s", "1MiB"), "get_layers takes --prompt, not -s/-a"),
        (("lookup", "-a"), "lookup takes --prompt, not -s/-a"),
        (("lookup", "--prompt", "4k"), "bad --prompt"),
        (("get_layers", "--prompt", "8"), "--prompt must be at least one block"),
    ],
)
def test_bad_arguments_are_refused_with_a_message(argv: tuple[str, ...], message: str) -> None:
    assert message in refused(*argv)


@pytest.mark.parametrize(
    "argv",
    [
        ("write", "-s", "1MiB", "-a"),  # one size or a sweep
        ("write", "-n", "5", "-D", "1"),  # iterations or seconds
        ("write", "--local", "--meta", "127.0.0.1:1"),  # start one or use one
        ("write", "--transport", "rdma"),
        ("scan",),
    ],
)
def test_exclusive_and_unknown_options_are_usage_errors(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(list(argv))
    assert exc.value.code == 2
    assert "gcache-bench" in capsys.readouterr().err
