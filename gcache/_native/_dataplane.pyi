from collections.abc import Sequence

ALGO_XXH3: int
ALGO_CRC32C: int
HW_CRC32C: int

def checksums(
    src: Sequence[memoryview | bytes | bytearray], group: int, algo: int = 0, threads: int = 0
) -> bytes: ...
def copy_checksums(
    dst: Sequence[memoryview | bytes | bytearray],
    src: Sequence[memoryview | bytes | bytearray],
    group: int,
    hash_src: bool = False,
    algo: int = 0,
    threads: int = 0,
) -> bytes: ...
def read_layer(
    seg: memoryview | bytes | bytearray,
    kdst: memoryview | bytes | bytearray,
    vdst: memoryview | bytes | bytearray,
    offsets: memoryview | bytes | bytearray,
    rows: memoryview | bytes | bytearray,
    sums: memoryview | bytes | bytearray,
    stride: int,
    li: int,
    off: int,
    kb: int,
    vb: int,
    threads: int = 0,
) -> int: ...
def set_threads(n: int, /) -> int: ...
