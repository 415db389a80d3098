"""Time to first token in vLLM (CPU) for a long prompt whose prefix was seen before,
several ways in one run:

* ``cold``: the prompt in a vLLM instance that has never seen it;
* ``ideal``: the same instance again, with a new ending after the same prefix:
  vLLM's own prefix cache holds the prefix (the best any KV store can do);
* ``gcache``: a *fresh* vLLM instance whose own cache is empty, with
  ``GCacheConnector``: the prefix is loaded from GCache (stored there by another
  vLLM instance that ran the first prompt), the ending computed.

Run with the vLLM environment (``make venv-vllm``)::

    .venv-vllm/bin/python bench/vllm_ttft.py            # 8192-token prompts, 7680 seen

Each way runs ``--repeat`` prompts (distinct prefixes, so no repetition hits a
cache it should not); the table shows medians and ``gcache / ideal``. The model
is a Llama (seeded random weights written as a safetensors checkpoint, loaded
normally), wide enough that the cold prefill takes seconds on a small CPU. Every
vLLM instance runs in its own process (the ``--phase`` entry points below), with
the same settings; GCache is a real ``gcache up`` (``LocalDeployment``) with one
server on this machine (shared-memory transport).

The *ideal* instance and one GCache reader per way (``--readers``: way name ->
connector settings, default the connector's defaults, ``load_mode: async`` and
the pre-12/2026 placement) stay up side by side and take their timed prompts in
turns (ideal, A, B, B, A, ideal, ...), so a change in the load of a shared machine
hits every way alike; the writer has finished before. Readers load only
(``store: false``): one way's stores must not serve another's prompt.
``--omp-bind`` gives every instance the same OpenMP cores: by default vLLM
reserves one core more for an instance with a KV connector, and on a small
machine the ideal and the readers then run different numbers of OpenMP threads.
Each timed request also reports the vLLM worker's threads: the main (OpenMP 0)
thread's involuntary context switches and CPU seconds per CPU mask.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VOCAB = 4096


# ---- the model ------------------------------------------------------------------------


def write_llama(out: Path, *, hidden: int, layers: int, heads: int, kv_heads: int) -> Path:
    """A Llama checkpoint (config.json + model.safetensors) from a fixed seed."""
    import torch
    from safetensors.torch import save_file

    head_dim = hidden // heads
    inter = 3 * hidden
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * (scale or shape[-1] ** -0.5)

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "vocab_size": VOCAB,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    t: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": rand(VOCAB, hidden, scale=1.0),
        "model.norm.weight": torch.ones(hidden),
        "lm_head.weight": rand(VOCAB, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = torch.ones(hidden)
        t[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        t[p + "self_attn.q_proj.weight"] = rand(heads * head_dim, hidden)
        t[p + "self_attn.k_proj.weight"] = rand(kv_heads * head_dim, hidden)
        t[p + "self_attn.v_proj.weight"] = rand(kv_heads * head_dim, hidden)
        t[p + "self_attn.o_proj.weight"] = rand(hidden, heads * head_dim)
        t[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        t[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        t[p + "mlp.down_proj.weight"] = rand(hidden, inter)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file(t, str(out / "model.safetensors"))
    return out


def prompts(args: argparse.Namespace) -> dict[str, list[list[int]]]:
    """Per repetition: a prefix, the first ending (run by cold / the writer) and a
    second ending (ideal / the GCache reader). Random tokens from a fixed seed."""
    import numpy as np

    rng = np.random.default_rng(1)
    out: dict[str, list[list[int]]] = {"first": [], "second": [], "warm": []}
    for _ in range(args.repeat):
        prefix = rng.integers(3, VOCAB, args.prefix).tolist()
        out["first"].append(prefix + rng.integers(3, VOCAB, args.suffix).tolist())
        out["second"].append(prefix + rng.integers(3, VOCAB, args.suffix).tolist())
    out["warm"].append(rng.integers(3, VOCAB, 300).tolist())
    # A long warm-up pair: the writer stores the first, the reader loads the
    # second from GCache before it is timed (a fresh instance's own cache is
    # empty, but its first long load pays one-off allocations that are not TTFT).
    prefix = rng.integers(3, VOCAB, args.prefix).tolist()
    out["warm_first"] = [prefix + rng.integers(3, VOCAB, args.suffix).tolist()]
    out["warm_second"] = [prefix + rng.integers(3, VOCAB, args.suffix).tolist()]
    return out


# ---- one vLLM instance (a child process) ---------------------------------------------


def make_llm(args: argparse.Namespace, connector: dict[str, Any] | None) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if connector is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="GCacheConnector",
            kv_connector_module_path="gcache_client.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=connector,
        )
    return LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.1,
        max_model_len=args.prefix + args.suffix + 64,
        max_num_batched_tokens=args.batched_tokens,
        max_num_seqs=4,
        enable_prefix_caching=True,
        disable_log_stats=False,
        seed=0,
        **kw,
    )


def ttft(llm: Any, ids: list[int]) -> tuple[float, int]:
    """Seconds until the first token of ``ids`` (one request, max_tokens=1), and it."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
    return time.perf_counter() - t0, int(out[0].outputs[0].token_ids[0])


def counters(llm: Any) -> dict[str, int]:
    got: dict[str, int] = {"external_tokens": 0, "local_cache_tokens": 0, "external_hits": 0}
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_by_source":
            src = m.labels.get("source", "")
            if src == "external_kv_transfer":
                got["external_tokens"] += int(m.value)
            elif src == "local_cache_hit":
                got["local_cache_tokens"] += int(m.value)
        elif m.name == "vllm:external_prefix_cache_hits":
            got["external_hits"] += int(m.value)
        elif m.name == "vllm:external_prefix_cache_queries":
            got["external_queries"] = got.get("external_queries", 0) + int(m.value)
        elif m.name == "vllm:prompt_tokens":
            got["prompt_tokens"] = got.get("prompt_tokens", 0) + int(m.value)
    return got


def phase(args: argparse.Namespace) -> dict[str, Any]:
    """The writer runs its prompts and exits; ``local`` and ``reader`` warm up, say
    ``READY`` and then run what the driver sends on stdin, one JSON line per
    request (``{"way": ..., "i": ...}``), answering ``RESULT`` lines."""
    ps = prompts(args)
    connector = json.loads(args.connector) if args.connector else None
    llm = make_llm(args, connector)
    ttft(llm, ps["warm"][0])  # first-request overheads out of the way
    if args.phase == "writer":
        res: dict[str, Any] = {"writer": [ttft(llm, p) for p in ps["warm_first"] + ps["first"]]}
        time.sleep(args.settle)  # background stores finish
        res["counters"] = counters(llm)
        return res
    if args.phase == "reader":
        ttft(llm, ps["warm_second"][0])  # a fresh process's first long load
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["way"] == "done":
            break
        prompt = ps["first" if cmd["way"] == "cold" else "second"][cmd["i"]]
        before = worker_threads()
        t, tok = ttft(llm, prompt)
        print("RESULT " + json.dumps([t, tok, thread_delta(before, worker_threads())]), flush=True)
    return {"counters": counters(llm)}


def worker_threads() -> dict[str, list[float]]:
    """Per thread of this instance's vLLM worker process (a descendant named
    ``VLLM::Worker``): [CPU seconds, involuntary context switches, CPUs allowed]."""
    out: dict[str, list[float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in Path("/proc").iterdir():
        try:
            if not pid.name.isdigit() or (pid / "comm").read_text().strip() != "VLLM::Worker":
                continue
            if not _descends(int(pid.name), os.getpid()):
                continue
            for task in (pid / "task").iterdir():
                stat = (task / "stat").read_text().rsplit(")", 1)[1].split()
                status = dict(ln.split(":", 1) for ln in (task / "status").read_text().splitlines())
                cpu = (int(stat[11]) + int(stat[12])) / tick
                nv = float(status["nonvoluntary_ctxt_switches"])
                tag = f"{pid.name}/{task.name}:{status['Cpus_allowed_list'].strip()}"
                out[tag] = [cpu, nv]
        except (OSError, ValueError, KeyError):
            continue
    return out


def _descends(pid: int, root: int) -> bool:
    while pid > 1:
        if pid == root:
            return True
        try:
            pid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            return False
    return False


def thread_delta(a: dict[str, list[float]], b: dict[str, list[float]]) -> dict[str, Any]:
    """What one request cost the worker's threads: the main thread's (OpenMP thread
    0) involuntary switches, and CPU seconds per CPU mask (threads that ran)."""
    main_nv = 0.0
    cpu: dict[str, float] = {}
    for tag, (c, nv) in b.items():
        c0, nv0 = a.get(tag, [0.0, 0.0])
        pid_tid, mask = tag.split(":", 1)
        pid, tid = pid_tid.split("/")
        if pid == tid:
            main_nv = nv - nv0
        if c > c0:
            cpu[mask] = round(cpu.get(mask, 0.0) + c - c0, 3)
    return {"main_involuntary_switches": main_nv, "cpu_s_by_mask": cpu}


# ---- the driver -----------------------------------------------------------------------


def phase_cmd(args: argparse.Namespace, name: str, connector: dict[str, Any] | None) -> list[str]:
    cmd = [sys.executable, __file__, "--phase", name, "--model", args.model]
    for opt in ("prefix", "suffix", "repeat", "batched_tokens", "settle"):
        cmd += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
    if connector is not None:
        cmd += ["--connector", json.dumps(connector)]
    return cmd


def phase_env(args: argparse.Namespace, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_space_gib))
    if args.omp_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    return {**env, **(extra or {})}


def run_phase(args: argparse.Namespace, name: str, connector: dict[str, Any] | None) -> Any:
    print(f"[{name}] starting a vLLM instance ...", flush=True)
    t0 = time.perf_counter()
    cmd = phase_cmd(args, name, connector)
    proc = subprocess.run(cmd, env=phase_env(args), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"phase {name} failed with exit code {proc.returncode}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    print(f"[{name}] done in {time.perf_counter() - t0:.0f} s", flush=True)
    return json.loads(line[len("RESULT ") :])


class Instance:
    """A vLLM instance kept up in a child process, taking prompts one at a time."""

    def __init__(
        self,
        args: argparse.Namespace,
        name: str,
        connector: dict[str, Any] | None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the child)
        self.proc = subprocess.Popen(
            phase_cmd(args, "reader" if connector is not None else name, connector),
            env=phase_env(args, env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
        )
        print(f"[{name}] starting a vLLM instance ...", flush=True)
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix) :].strip()
        self.log.seek(0)
        sys.stderr.write(self.log.read()[-8000:].decode(errors="replace"))
        raise SystemExit(f"instance {self.name} exited with {self.proc.wait()}")

    def ask(self, way: str, i: int = 0) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"way": way, "i": i}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("RESULT "))

    def close(self) -> Any:
        res = self.ask("done")
        self.proc.wait(timeout=120)
        return res


def main_driver(args: argparse.Namespace) -> None:
    from gcache.cli.deploy import LocalDeployment

    with tempfile.TemporaryDirectory() as tmp:
        if not args.model:
            args.model = str(
                write_llama(
                    Path(tmp) / "model",
                    hidden=args.hidden,
                    layers=args.layers,
                    heads=args.heads,
                    kv_heads=args.kv_heads,
                )
            )
        with LocalDeployment(Path(tmp) / "gc", servers=1, capacity=args.capacity) as d:
            conn = {
                "meta": d.meta_addr,
                "meta_grpc": d.meta_grpc,
                "transport": args.transport,
                "model_id": "bench/vllm-ttft",
                **json.loads(args.extra),
            }
            writer = run_phase(args, "writer", conn)
            loc = Instance(args, "local", None)
            cold_r = [loc.ask("cold", i) for i in range(args.repeat)]
            readers = {
                # Readers load only: one way's stores must not serve another's prompt.
                name: Instance(args, name, {**conn, "store": False, **way["extra"]}, way["env"])
                for name, way in reader_ways(args).items()
            }
            results: dict[str, list[Any]] = {"ideal": [], **{n: [] for n in readers}}
            turn: list[tuple[str, Instance]] = [("ideal", loc), *readers.items()]
            loads: list[str] = []
            for i in range(args.repeat):  # in turns: ideal, A, B, B, A, ideal, ...
                loads.append(Path("/proc/loadavg").read_text().strip())
                for name, inst in turn if i % 2 == 0 else turn[::-1]:
                    results[name].append(inst.ask("ideal" if inst is loc else "gcache", i))
            local = {"counters": loc.close()["counters"]}
            rcounters = {n: r.close()["counters"] for n, r in readers.items()}
            meta = d.stats()
    cold = [r[0] for r in cold_r]
    runs = {"cold": cold, **{n: [x[0] for x in r] for n, r in results.items()}}
    threads = {n: [x[2] for x in r] for n, r in results.items()}
    ideal = runs["ideal"]
    same = {
        n: all(a[1] == b[1] for a, b in zip(results["ideal"], r, strict=True))
        for n, r in results.items()
    }
    row = {
        "cold_s": statistics.median(cold),
        "ideal_s": statistics.median(ideal),
        "runs": runs,
        "over_ideal": {n: statistics.median(r) / statistics.median(ideal) for n, r in runs.items()},
        "first_tokens_equal": same,
        "loadavg": loads,
        "worker_threads": threads,
        "local_counters": local["counters"],
        "writer_counters": writer["counters"],
        "reader_counters": rcounters,
        "meta_objects": getattr(meta, "objects", None),
        "omp_bind": args.omp_bind,
    }
    n = args.prefix + args.suffix
    print()
    print(
        f"prompt {n} tokens, first {args.prefix} seen before; Llama {args.layers} layers x "
        f"{args.hidden} ({args.heads} heads, {args.kv_heads} KV heads), float32, "
        f"{args.repeat} prompts each"
    )
    print(f"{'way':<16} {'TTFT median [s]':>16} {'vs ideal':>9}   runs [s]")
    for name, r in runs.items():
        med = statistics.median(r)
        print(
            f"{name:<16} {med:>16.3f} {med / row['ideal_s']:>8.2f}x   "
            + " ".join(f"{x:.3f}" for x in r)
        )
    for name, rc in rcounters.items():
        print(
            f"{name}: {rc['external_tokens']} prompt tokens loaded from GCache "
            f"(vLLM external_kv_transfer), local cache {rc['local_cache_tokens']}; "
            f"first tokens equal to ideal: {same[name]}"
        )
    print(
        f"ideal run's local cache tokens {local['counters']['local_cache_tokens']}; "
        f"load average at each turn: {loads}"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1))


DEFAULT_READERS = json.dumps(
    {
        "gcache": {},  # the defaults: load_mode auto, client_cpus auto
        "gcache_async": {"load_mode": "async"},
        "gcache_unplaced": {"load_mode": "layerwise", "client_cpus": "none"},  # until 12/2026
    }
)


def reader_ways(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``--readers``: way name -> extra connector settings; a key ``env`` inside
    holds environment variables for that instance only."""
    out: dict[str, dict[str, Any]] = {}
    for name, extra in json.loads(args.readers).items():
        extra = dict(extra)
        env = {k: str(v) for k, v in extra.pop("env", {}).items()}
        out[name] = {"extra": extra, "env": env}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, default=7680, help="tokens seen before")
    ap.add_argument("--suffix", type=int, default=512, help="new tokens after them")
    ap.add_argument("--repeat", type=int, default=3, help="prompts per way")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--batched-tokens", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--kv-space-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--capacity", default="1GiB", help="the GCache server's capacity")
    ap.add_argument("--transport", default="shm", choices=("shm", "tcp"))
    ap.add_argument(
        "--omp-bind",
        default="",
        help="VLLM_CPU_OMP_THREADS_BIND for every instance (default: vLLM's choice, which "
        "reserves a core more with a KV connector: the ideal and GCache ways then differ)",
    )
    ap.add_argument("--settle", type=float, default=3.0, help="s for the writer's stores")
    ap.add_argument("--model", default="", help="a checkpoint dir (default: write one)")
    ap.add_argument("--json", default="", help="write the results here too")
    ap.add_argument("--extra", default="{}", help="more kv_connector_extra_config (JSON)")
    ap.add_argument(
        "--readers",
        default=DEFAULT_READERS,
        help="GCache reader instances, each a way: JSON name -> extra connector settings",
    )
    ap.add_argument("--phase", choices=("local", "writer", "reader"), help=argparse.SUPPRESS)
    ap.add_argument("--connector", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print("RESULT " + json.dumps(phase(args)), flush=True)
    else:
        main_driver(args)


if __name__ == "__main__":
    main()
