"""The sharded MoE layer over several processes, one command:

    python examples/multiprocess_moe.py [--timeout 300]      # 2 CPU processes (gloo)
    python examples/multiprocess_moe.py --gpus 8             # 8 processes, one GPU each (NCCL)

The launcher picks a free localhost port and starts 2 worker processes (this
file with --worker 0 / --worker 1), each with 4 host CPU devices. Every worker
calls jax.distributed.initialize(coordinator_address="localhost:PORT",
num_processes=2, process_id=i), so jax.devices() lists the 8 devices of both
processes and a Mesh over them spans the two processes. Each worker builds the
same global inputs (same seed), places them on the mesh, runs
jax_moe.moe_forward_sharded with both strategies on several (ep, tp) meshes,
and checks the output rows it holds against jax_moe.moe_forward computed on
one of its own devices. The launcher waits (with a timeout), checks both exit
codes and exits non-zero if either worker failed.

With --gpus N the launcher starts N workers instead; worker i sees only GPU i
(CUDA_VISIBLE_DEVICES=i, JAX_PLATFORMS=cuda, and NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1: no NVLink
multicast) and calls jax.distributed.initialize(..., num_processes=N,
process_id=i), so the global mesh has N GPUs, one per process, and the
collectives go through NCCL. The meshes checked are every factorisation
ep x tp of N; everything else (inputs, the check of each process's rows against
moe_forward on its own device) is the CPU mode's.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 4
# (ep, tp, how the 8 global devices are laid out). jax.devices() lists process
# 0's devices first, so "rows" keeps a tp group inside one process (ep spans
# the processes) and "cols" puts the two halves of each tp group in different
# processes.
MESHES = [(8, 1, "rows"), (2, 4, "rows"), (4, 2, "cols")]
# --gpus N: no NVLink multicast in NCCL (or in anything else that might use it).
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "NVSHMEM_DISABLE_NVLS": "1"}


# ---------------------------------------------------------------- launcher

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _worker_env(process_id: int, gpus: int) -> dict:
    env = dict(os.environ)
    if gpus:  # one GPU per process
        env.update(GPU_ENV, CUDA_VISIBLE_DEVICES=str(process_id), JAX_PLATFORMS="cuda")
        return env
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    flags.append(f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}")
    env["XLA_FLAGS"] = " ".join(flags)
    env["JAX_PLATFORMS"] = "cpu"
    return env


def launch(timeout: float, gpus: int = 0) -> int:
    port = _free_port()
    num = gpus or NUM_PROCESSES
    print(f"launcher: {num} workers, coordinator localhost:{port}", flush=True)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(i),
                               "--port", str(port), "--gpus", str(gpus)],
                              env=_worker_env(i, gpus))
             for i in range(num)]
    deadline = time.monotonic() + timeout
    codes = [None] * num
    try:
        for i, proc in enumerate(procs):
            codes[i] = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        print(f"launcher: timed out after {timeout:.0f} s", flush=True)
    finally:
        for proc in procs:  # only the workers this launcher started
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for i, code in enumerate(codes):
        print(f"launcher: worker {i} exit code {code}", flush=True)
    ok = all(code == 0 for code in codes)
    print("launcher: OK" if ok else "launcher: FAILED", flush=True)
    return 0 if ok else 1


# ------------------------------------------------------------------ worker

def _say(text: str) -> None:
    """One write per line, so the two workers' lines do not interleave."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _meshes(n: int, gpus: int):
    """(ep, tp, layout) to check: MESHES on CPU, every ep x tp = n with --gpus."""
    if not gpus:
        return MESHES
    return [(ep, n // ep, "rows") for ep in range(n, 0, -1) if n % ep == 0]


def _problem(n: int):
    """(T, H, I, E, k): T, E and I divisible by every factor of the n devices.
    (64, 32, 16, 8, 2) on CPU and for 1, 2, 4 or 8 GPUs."""
    t = 64 if 64 % n == 0 else 8 * n
    i = 16 if 16 % n == 0 else 16 * n
    e = 8 if 8 % n == 0 else 8 * n
    return t, 32, i, e, 2


def worker(process_id: int, port: int, gpus: int = 0) -> int:
    import jax

    num_processes = gpus or NUM_PROCESSES
    if gpus:
        # The launcher set JAX_PLATFORMS=cuda and CUDA_VISIBLE_DEVICES=process_id:
        # one GPU per process; cross-process collectives go through NCCL.
        jax.config.update("jax_default_matmul_precision", "highest")  # no TF32
    else:
        jax.config.update("jax_platforms", "cpu")
        # Cross-process collectives on CPU go through gloo (jax's default in 0.10;
        # set explicitly so that an older default, "none", cannot slip in).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}",
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=120)

    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import jax_moe
    from jax_moe.parallel import moe_forward_sharded, moe_shardings

    name = f"worker {process_id}"
    devices = jax.devices()
    local = jax.local_devices()
    _say(f"{name}: {len(local)} local of {len(devices)} devices, "
         f"process_count={jax.process_count()}")
    if gpus:
        assert jax.default_backend() == "gpu" and len(local) == 1, (jax.default_backend(), local)
        assert len(devices) == gpus
    else:
        assert len(devices) == NUM_PROCESSES * DEVICES_PER_PROCESS

    t, h, i, e, k = _problem(len(devices))
    rng = np.random.default_rng(1234)  # the same inputs in every process
    x = rng.standard_normal((t, h)).astype(np.float32)
    logits = (rng.standard_normal((t, e)) * 2.0).astype(np.float32)
    logits[:, 5] += 3.0  # uneven load
    w13 = (rng.standard_normal((e, 2 * i, h)) * h**-0.5).astype(np.float32)
    w2 = (rng.standard_normal((e, h, i)) * i**-0.5).astype(np.float32)

    # The single-process layer, on one of this process's own devices.
    with jax.default_device(local[0]):
        want = np.asarray(jax.jit(jax_moe.moe_forward, static_argnames=("topk",))(
            x, logits, w13, w2, topk=k))

    def put(a, sharding):  # a global array from the copy every process holds
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    failures = 0
    for ep, tp, layout in _meshes(len(devices), gpus):
        grid = np.asarray(devices).reshape(ep, tp) if layout == "rows" else \
            np.asarray(devices).reshape(tp, ep).T
        mesh = Mesh(grid, ("ep", "tp"))
        sh = moe_shardings(mesh)
        args = (put(x, sh["hidden_states"]), put(logits, sh["router_logits"]),
                put(w13.reshape(e, 2, i, h), sh["w13"]), put(w2, sh["w2"]))
        for strategy in ("allgather", "all_to_all"):
            fn = jax.jit(lambda a, b, c, d, s=strategy, m=mesh: moe_forward_sharded(
                a, b, c, d, k, mesh=m, strategy=s))
            out = jax.block_until_ready(fn(*args))
            worst = 0.0
            for shard in out.addressable_shards:  # the rows this process holds
                got = np.asarray(shard.data)
                ref = want[shard.index]
                worst = max(worst, float(np.linalg.norm(got - ref) / np.linalg.norm(ref)))
            ok = out.shape == want.shape and worst < 1e-5
            failures += not ok
            _say(f"{name}: mesh ep={ep} tp={tp} ({layout}) {strategy:10s} "
                 f"{len(out.addressable_shards)} local shards, rel err {worst:.2e} "
                 f"{'ok' if ok else 'MISMATCH'}")
    jax.distributed.shutdown()
    return 1 if failures else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the workers are killed")
    p.add_argument("--gpus", type=int, default=0, metavar="N",
                   help="N worker processes with one GPU each (worker i: CUDA_VISIBLE_DEVICES=i, "
                        "NCCL), meshes = every ep x tp = N; default 0: the 2-process CPU run")
    args = p.parse_args()
    if args.gpus < 0:
        p.error("--gpus must be >= 0")
    if args.worker is None:
        return launch(args.timeout, args.gpus)
    return worker(args.worker, args.port, args.gpus)


if __name__ == "__main__":
    sys.exit(main())
