from typing import Any

from numpy.typing import NDArray

Col = NDArray[Any]

def heap_sift(heap: Col, tick: Col, seq: Col, hpos: Col, size: int, i: int, /) -> int: ...
def key_find1(table: Col, k0: Col, k1: Col, ns: Col, key: bytes, nsid: int, /) -> int: ...
def key_find_list(
    table: Col, k0: Col, k1: Col, ns: Col, keys: list[bytes], nsid: int, out: Col, /
) -> None: ...
def key_prefix(
    table: Col,
    k0: Col,
    k1: Col,
    ns: Col,
    obj: Col,
    groups: int,
    nsid: int,
    keys: list[bytes],
    full: int,
    /,
) -> list[int]: ...
def key_slot(table: Col, k0: Col, ns: Col, bid: int, /) -> int: ...
def match(
    table: Col,
    k0: Col,
    k1: Col,
    ns: Col,
    obj: Col,
    groups: int,
    nsid: int,
    keys: list[bytes],
    group: int,
    /,
) -> int: ...
def live_get(keys: Col, vals: Col, k: int, /) -> int: ...
def live_put(keys: Col, vals: Col, k: int, v: int, /) -> int: ...
def live_pop(keys: Col, vals: Col, k: int, /) -> int: ...
def live_put_many(keys: Col, vals: Col, units: Col, values: Col, /) -> int: ...
def live_get_many(keys: Col, vals: Col, units: Col, out: Col, /) -> int: ...
def key_find_cols(
    table: Col, k0: Col, k1: Col, ns: Col, q0: Col, q1: Col, nsid: int, out: Col, /
) -> None: ...
def key_place(table: Col, k0: Col, ns: Col, ids: Col, /) -> int: ...
def lease_rows(
    rows: list[int],
    tick: int,
    atime: float,
    pins: Col,
    block: Col,
    tick_col: Col,
    atime_col: Col,
    hpos: Col,
    hseq: Col,
    tier: Col,
    server: Col,
    offset: Col,
    length: Col,
    group: Col,
    sums_len: Col,
    sums_slot: Col,
    pos: Col,
    slabs: dict[int, Col],
    heap0: Col,
    size0: int,
    seq0: int,
    heap1: Col,
    size1: int,
    seq1: int,
    /,
) -> tuple[list[tuple[int, int, int, int, int, int, bytes]], int, int]: ...
def unpin_rows(
    rows: list[int],
    pins: Col,
    block: Col,
    hpos: Col,
    group: Col,
    tier: Col,
    ns: Col,
    hot: Col,
    children: Col,
    full: Col,
    /,
) -> list[int]: ...
