from typing import Any

from numpy.typing import NDArray

Col = NDArray[Any]

def heap_sift(heap: Col, tick: Col, seq: Col, hpos: Col, size: int, i: int, /) -> int: ...
def key_find1(table: Col, k0: Col, k1: Col, ns: Col, key: bytes, nsid: int, /) -> int: ...
def key_find_list(
    table: Col, k0: Col, k1: Col, ns: Col, keys: list[bytes], nsid: int, out: Col, /
) -> None: ...
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
