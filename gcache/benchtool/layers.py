"""``gcache-bench get_layers``: a whole prompt fetched layer by layer while the
caller computes.

The prompt's KV (zeros of the layout's shape; checksums are still computed and
verified) is put once, and read back into preallocated buffers as an engine does.
A transfer-only pass measures how long each layer takes to arrive when nobody
computes. Then each iteration fetches the prompt again while the
caller spends ``compute_s`` per layer (``sleep``, or a numpy ``matmul`` sized to
take that long), and records the time to the first layer and the total.
``overlap = (compute-only time + one layer's transfer) / measured time``: 1.0 means
transfers hid completely behind compute. The compute-only time is measured (the
caller's work alone, ``num_layers`` times), for ``sleep`` as for ``matmul``.

No stream can reach 1.0 when layer 0 is large: the caller cannot start before
layer 0 has arrived, so the measured time is at least layer 0's transfer plus the
compute, and the best overlap is ``(C + T/L) / (C + t0)`` (``C`` compute-only,
``T`` the transfer of all ``L`` layers, ``t0`` layer 0's). With compute = transfer
(the default) that is ``(1 + 1/L) / (1 + f0)``, ``f0`` layer 0's share of the bytes:
0.922 for MiMo-V2-Flash at 32k tokens (48 layers, layer 0 one of 9 full layers,
f0 = 0.107). ``overlap_best`` reports that bound for the run's own figures.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from gcache.benchtool.stats import Progress, Samples
from gcache.layout import Layout
from gcache_client import GCacheClient, Namespace


def zero_kv(layout: Layout, ntokens: int) -> list[tuple[np.ndarray, np.ndarray]]:
    from gcache_client.arrays import NUMPY_DTYPES

    dt = NUMPY_DTYPES[layout.dtype]
    nblocks = ntokens // layout.block_size
    out = []
    for i, spec in enumerate(layout.spec.layers):
        g = layout.layer_group[i]
        windowed = layout.group_tail_blocks[g] is not None
        rows = len(layout.window_blocks(g, nblocks)) * layout.block_size if windowed else ntokens
        out.append(
            (
                np.zeros((rows, spec.kv_heads, spec.k_head_dim), dt),
                np.zeros((rows, spec.kv_heads, spec.v_head_dim), dt),
            )
        )
    return out


class MatmulCompute:
    """A CPU-bound stand-in for a layer's compute that releases the GIL (BLAS)."""

    def __init__(self, seconds: float) -> None:
        self.a = np.ones((256, 256), np.float32)
        t0 = time.perf_counter()
        for _ in range(20):
            self.a @ self.a
        per = (time.perf_counter() - t0) / 20
        self.reps = max(1, round(seconds / per))

    def __call__(self) -> None:
        for _ in range(self.reps):
            self.a @ self.a


def run_get_layers(
    client: GCacheClient,
    ns: Namespace,
    tokens: np.ndarray,
    iters: int,
    compute: str,
    compute_us: float,
    progress: Progress,
) -> tuple[Samples, dict[str, Any]]:
    layout = ns.layout
    kv = zero_kv(layout, len(tokens))
    res = client.put(ns, tokens, kv)
    if not res.ok:
        raise RuntimeError(f"could not store the prompt: {res}")
    # The engine's own KV buffers, allocated and faulted in once, reused by every
    # fetch (a fresh array per layer would measure page faults, not the store).
    out = [(np.full_like(k, 1), np.full_like(v, 1)) for k, v in kv]
    f0 = (kv[0][0].nbytes + kv[0][1].nbytes) / sum(k.nbytes + v.nbytes for k, v in kv)

    def fetch(work: Any) -> tuple[float, float, float, int]:
        m = client.match(ns, tokens)
        nbytes = 0
        t0 = time.perf_counter()
        first = 0.0
        stream = client.get_layers(m, out)
        for i, layer in enumerate(stream):
            if i == 0:
                first = time.perf_counter() - t0
            nbytes += layer.k.nbytes + layer.v.nbytes
            work()
        total = time.perf_counter() - t0
        client.release(m)
        if not stream.ok:
            raise RuntimeError(f"get_layers failed: {stream.error}")
        return t0, first, total, nbytes

    transfer = [fetch(lambda: None) for _ in range(3)]
    transfer_s = statistics.median(t[2] for t in transfer)
    per_layer = transfer_s / layout.num_layers
    c = compute_us / 1e6 if compute_us > 0 else per_layer
    if compute == "matmul":
        work: Any = MatmulCompute(c)
    else:

        def work() -> None:
            time.sleep(c)

    # Measured for sleep as for matmul (a sleep takes longer than asked: timer
    # slack, wake-up latency on a loaded machine), the fastest of 3 passes: the
    # overlap errs low, never high, when the machine is noisy.
    passes = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(layout.num_layers):
            work()
        passes.append(time.perf_counter() - t0)
    compute_only = min(passes)
    samples = Samples()
    firsts, totals = [], []
    for i in range(iters):
        t0, first, total, nbytes = fetch(work)
        samples.add(t0, t0 + total, nbytes)
        firsts.append(first)
        totals.append(total)
        progress.update(i + 1)
    progress.close()
    measured = statistics.median(totals)
    extra = {
        "prompt_tokens": len(tokens),
        "layers": layout.num_layers,
        "compute": compute,
        "compute_per_layer_us": c * 1e6,
        "transfer_only_us": transfer_s * 1e6,
        "compute_only_us": compute_only * 1e6,
        "ttfl_us": statistics.median(firsts) * 1e6,
        "total_us": measured * 1e6,
        "overlap": (compute_only + per_layer) / measured,
        "overlap_best": (compute_only + per_layer) / (compute_only + transfer_s * f0),
    }
    return samples, extra
