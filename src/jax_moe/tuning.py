"""The hardware descriptor and the grouped GEMM's tuning tables.

``hardware()`` reads the current CUDA device (SM count, shared memory, L2,
compute capability) through the extension. ``group_gemm_tile_m`` picks the
GEMM's rows per tile at trace time: from the table of the GPU model JAX runs
on (``tuning_tables/<device kind>.json``, written by ``python -m
jax_moe.tune``) when it lists the problem, else by a rule on the average
number of rows per expert (``default_tile_m``).

tile_m = 16 is the TMA decode kernel (csrc/kernels/cuda/group_gemm/): the
decode kernel's job, up to 16 rows per tile, with the weights streamed by the tensor
memory accelerator. It runs on GPUs of compute capability 9.0 or newer for
bf16/f16 with K a multiple of 8, when the launch has at least 6 tiles per SM
(1.5 from K = 8192); otherwise tile_m = 16 runs the decode kernel (8). The
rule picks it wherever it would pick 8 and it is usable
(``tma_decode_usable``), and a table answer of 8 yields to it there (it is
the 8 kernel at the launches too small for it; tables written before it
existed answer 8).

tile_m = 256 is the Hopper kernels (wgmma + TMA, csrc/kernels/cuda/
group_gemm/*_sm90a.cu): the own kernel where experts average at most
``WGMMA_MAX_AVG_ROWS`` = 128 rows, CUTLASS's beyond (both sum K in the same
order: the same bits). It is picked, by the rule or over the table, when all of
these hold (``sm90_usable``): the extension has it (``HAS_SM90_GEMM``), JAX's
default backend is a GPU and device 0 has compute capability 9.0 (H100/H200:
the kernel is sm_90a code), the dtype is bf16 or f16, N and K are multiples
of 8 (TMA's 16-byte alignment), and experts average more than
``DECODE_MAX_ROWS`` = 8 rows (below, the decode kernel reads the weights
fewer times). Tables written before tile 256 existed answer 128 where it
would run: such an answer yields to 256 under those conditions, and any
other table answer stands. Asked for explicitly where it cannot run, 256
runs the 128-row kernel.

``group_gemm_fp8_tile_m`` picks ops.group_gemm_fp8's kernel the same way,
from the table's "group_gemm_fp8" section (keys by x's dtype) or the rule
``default_fp8_tile_m``: 8 is its decode form, 64 and 128 the rows a tile of
its Hopper kernel (CUTLASS's blockwise-scaled fp8 GEMM, bf16 x:
``fp8_sm90_usable``).

Results are bitwise reproducible run to run for any choice. The mma.sync
tiles (32, 64, 128) give identical bits (each output sums K in the same
order); the decode kernel (8) splits K over 8 warps and adds the partial sums
in a fixed order, the TMA decode kernel (16) sums all of K in one warp in k
order, and the sm90 kernel (256) sums K in wgmma's order, so
any of them may differ from the others in the last bits (and tile 16 from
itself between launches below and above its size threshold, where it runs
the 8 kernel). The sm90 kernel stays
deterministic because its persistent tile scheduler has no split-K or
stream-K: one CTA computes each output tile over all of K in a fixed order.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pathlib

import jax
import jax.numpy as jnp

from jax_moe import _checks
from jax_moe._ffi import HAS_SM90_GEMM, WGMMA_MAX_AVG_ROWS, _ext

__all__ = ["hardware", "group_gemm_tile_m", "default_tile_m", "table_path", "load_table",
           "table_key", "table_file_name", "TILE_M", "MODEL_SHAPES", "SM90_TILE",
           "DECODE_MAX_ROWS", "sm90_device", "sm90_shape_ok", "sm90_usable", "TMA_TILE",
           "tma_decode_device", "tma_decode_usable", "wgmma_runs", "group_gemm_act_runs",
           "FP8_TILE_M", "FP8_DECODE_MAX_ROWS", "default_fp8_tile_m", "group_gemm_fp8_tile_m",
           "fp8_sm90_usable", "fp8_decode_runs"]

TILE_M = _checks.TILE_M
SM90_TILE = 256      # tile_m value of the Hopper kernels (own or CUTLASS: wgmma_runs)
TMA_TILE = 16        # tile_m value of the TMA decode kernel
# Rows per expert (average) up to which the rule picks the decode kernel (8);
# above, the sm90 kernel where usable. Measured on the H200 for the GEMMs of
# the four model shapes: up to 8 rows per expert the decode kernel is nearly
# always the fastest, at 32 to 64 rows the sm90 kernel always is (see
# docs/performance.md).
DECODE_MAX_ROWS = 8
# group_gemm_fp8's tiles (8: the decode form; 64, 128: the Hopper kernel's
# rows a tile) and the rows per expert (average) up to which its rule picks
# the decode form (measured on the H200, docs/performance.md).
FP8_TILE_M = _checks.FP8_TILE_M
FP8_DECODE_MAX_ROWS = 2
# (H, I, E, k) of the MoE layers that the shipped tables and the benchmarks
# cover: hidden size, expert intermediate size, experts, top-k.
MODEL_SHAPES = {
    "qwen3_30b_a3b": (2048, 768, 128, 8),
    "qwen3_235b_a22b": (4096, 1536, 128, 8),
    "mixtral_8x7b": (4096, 14336, 8, 2),
    "deepseek_v3": (7168, 2048, 256, 8),
}
_TABLE_DIR = pathlib.Path(__file__).with_name("tuning_tables")


def hardware(device: int = 0) -> dict | None:
    """The CUDA device `device` as a dict (name, sm_count, shared memory per
    block and per SM in bytes, l2_bytes, memory bus width and clock,
    compute capability), or None when the extension has no CUDA or no GPU is
    visible. Reads the device directly (no JAX involved)."""
    if not getattr(_ext, "has_cuda", False):
        return None
    return _ext.device_info(device)


@functools.cache
def _device0_capability() -> tuple[int, int]:
    """CUDA device 0's compute capability, (0, 0) without one; asked once."""
    hw = hardware()
    return tuple(int(c) for c in hw["compute_capability"]) if hw is not None else (0, 0)


def tma_decode_device() -> bool:
    """True when the TMA decode kernel can run here: JAX's default backend
    is a GPU and CUDA device 0 has compute capability 9.0 or newer. The
    device query is made once."""
    return _device_kind() is not None and _device0_capability()[0] >= 9


def _tma_rows_ok(k: int, dtype) -> bool:
    """What both TMA kernels need of x and w: bf16/f16 rows of K > 0
    elements, a multiple of 8 (16 bytes)."""
    return (jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
            and k % 8 == 0 and k > 0)


def tma_decode_usable(k: int, dtype) -> bool:
    """tma_decode_device() for bf16/f16 with K a multiple of 8 (16-byte rows)."""
    return _tma_rows_ok(k, dtype) and tma_decode_device()


def sm90_device() -> bool:
    """True when the sm90 kernel can run here: the extension has it
    (HAS_SM90_GEMM), JAX's default backend is a GPU and CUDA device 0 has
    compute capability 9.0. The device query is made once."""
    return HAS_SM90_GEMM and _device_kind() is not None and _device0_capability() == (9, 0)


def sm90_shape_ok(n: int, k: int, dtype) -> bool:
    """The problems the sm90 kernel takes: bf16/f16, N and K multiples of 8
    (16-byte rows for TMA), K > 0."""
    return _tma_rows_ok(k, dtype) and n % 8 == 0


def sm90_usable(n: int, k: int, dtype) -> bool:
    """sm90_device() and sm90_shape_ok(n, k, dtype)."""
    return sm90_shape_ok(n, k, dtype) and sm90_device()


def wgmma_runs(m: int, experts: int, n: int, k: int, dtype, act: bool = False) -> bool:
    """Where tile_m = 256 runs the own Hopper kernel for m rows and w
    (experts, n, k), with the gated activation in its epilogue when `act`:
    sm90_usable(n, k, dtype), experts averaging at most WGMMA_MAX_AVG_ROWS
    rows, and the kernel's shape limits (at most 1024 experts, experts * n
    below 2^31, with `act` n a multiple of 16). The extension answers from
    kernels/common/wgmma_rule.h, the rule the CUDA handler applies."""
    return (0 < m <= WGMMA_MAX_AVG_ROWS * experts
            and _ext.wgmma_fits(int(m), int(n), int(k), int(experts), bool(act))
            and sm90_usable(n, k, dtype))


def group_gemm_act_runs(m: int, experts: int, n: int, k: int, dtype) -> bool:
    """Where the forward-only layer runs its w13 GEMM (m rows, w13 (experts,
    n, k)) and the gated activation as one kernel (ops.group_gemm_act):
    wgmma_runs with the activation (n = 2 I a multiple of 16)."""
    return wgmma_runs(m, experts, n, k, dtype, act=True)


def default_tile_m(m: int, experts: int, sm90: bool | None = None,
                   tma: bool | None = None) -> int:
    """The rule used when no table has the problem, by average rows per
    expert (m / experts), fitted to the H200 tables: up to DECODE_MAX_ROWS,
    the decode kernel (it reads each touched expert's weights once), its TMA
    form (16) when `tma` (None: tma_decode_device()), else 8; above, the
    sm90 kernel (256) when `sm90` (None: sm90_device()), else 64-row tiles
    up to 48 rows and 128-row tiles beyond (32-row tiles never won)."""
    avg = m / max(experts, 1)
    if avg <= DECODE_MAX_ROWS:
        return TMA_TILE if (tma_decode_device() if tma is None else tma) else 8
    if sm90_device() if sm90 is None else sm90:
        return SM90_TILE
    if avg <= 48:
        return 64
    return 128


def default_fp8_tile_m(m: int, experts: int) -> int:
    """group_gemm_fp8's rule when no table has the problem: the decode form
    (8) up to FP8_DECODE_MAX_ROWS rows per expert on average, else 64-row
    tiles while the experts average fewer than 128 rows (less of each
    expert's last tile is wasted) and 128-row tiles beyond."""
    experts = max(experts, 1)
    if m <= FP8_DECODE_MAX_ROWS * experts:
        return 8
    return 64 if m < 128 * experts else 128


def fp8_sm90_usable(n: int, k: int, dtype) -> bool:
    """Where group_gemm_fp8's Hopper kernel runs: sm90_device(), bf16 x, N a
    multiple of 8 and K of 16 (K > 0)."""
    return (jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) and n % 8 == 0 and k % 16 == 0
            and k > 0 and sm90_device())


def fp8_decode_runs(tile: int, experts: int, k: int) -> bool:
    """Whether tile_m = `tile` runs group_gemm_fp8's decode form on a CUDA
    device (K a multiple of 16, its shared memory within the cap): the
    extension's own rule (kernels/common/fp8_decode_rule.h)."""
    return tile == 8 and bool(_ext.group_gemm_fp8_decode_fits(experts, k))


def group_gemm_fp8_tile_m(m: int, experts: int, n: int, k: int, dtype, tile_m=None) -> int:
    """tile_m for a group_gemm_fp8 of m rows, w (experts, n, k), x of
    `dtype`: the caller's choice when given, else the entry of the table's
    "group_gemm_fp8" section whose m is nearest (log scale), else
    default_fp8_tile_m. Trace-time only."""
    if tile_m is not None:
        return _checks.fp8_tile_m(tile_m)
    kind = _device_kind()
    table = load_table(kind, "group_gemm_fp8") if kind else {}
    entries = table.get(table_key(experts, n, k, dtype))
    if entries and m > 0:
        return int(min(entries, key=lambda e: abs(math.log2(max(e[0], 1)) - math.log2(m)))[1])
    return default_fp8_tile_m(m, experts)


def table_key(experts: int, n: int, k: int, dtype) -> str:
    return f"{jnp.dtype(dtype).name}/E{experts}/N{n}/K{k}"


def table_file_name(device_kind: str) -> str:
    """The table's file name for a GPU model: "NVIDIA H200" -> "NVIDIA_H200.json"."""
    return "".join(c if c.isalnum() else "_" for c in device_kind) + ".json"


def table_path(device_kind: str) -> pathlib.Path:
    """Where the table of a GPU model lives (``JAX_MOE_TUNING_DIR`` overrides
    the directory shipped with the package)."""
    root = pathlib.Path(os.environ.get("JAX_MOE_TUNING_DIR", _TABLE_DIR))
    return root / table_file_name(device_kind)


@functools.cache
def load_table(device_kind: str, section: str = "group_gemm") -> dict:
    """{key: [[m, tile_m], ...]} of the GPU model's table section
    ("group_gemm", or "group_gemm_fp8" for the fp8 GEMM's keyed by x's dtype),
    or {} when there is none."""
    path = table_path(device_kind)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:  # not JSON
        raise ValueError(f"jax_moe tuning table {path} is not JSON ({exc}); regenerate it "
                         "with `python -m jax_moe.tune` or remove it") from None
    return _checked_table(data, path, section)


def _checked_table(data, path, section: str = "group_gemm") -> dict:
    """data[section], each of its entries checked whole: a malformed
    table is an error naming the file and the key, never a tile read wrongly.
    The file holds "group_gemm", "group_gemm_fp8" or both; an absent section
    is {}."""
    def bad(where: str, what: str):
        return ValueError(f"jax_moe tuning table {path}: {where} {what}; regenerate it with "
                          "`python -m jax_moe.tune` or remove it")

    def is_int(v):  # JSON ints only: no bools, no 8.5, no Infinity
        return isinstance(v, int) and not isinstance(v, bool)

    if not isinstance(data, dict) or not any(
            isinstance(data.get(name), dict) for name in ("group_gemm", "group_gemm_fp8")):
        raise bad('"group_gemm"', "must be an object of {key: [[m, tile_m], ...]}")
    if section not in data:  # a table of the other GEMM only (tune --fp8 writes one)
        return {}
    table, tiles = data[section], FP8_TILE_M if section == "group_gemm_fp8" else TILE_M
    if not isinstance(table, dict):
        raise bad(f'"{section}"', "must be an object of {key: [[m, tile_m], ...]}")
    for key, entries in table.items():
        if not isinstance(entries, list) or not entries:
            raise bad(f"{section}[{key!r}]", "must be a non-empty list of [m, tile_m] pairs")
        for i, entry in enumerate(entries):
            where = f"{section}[{key!r}][{i}]"
            if not isinstance(entry, list) or len(entry) != 2:
                raise bad(where, f"must be a pair [m, tile_m], got {entry!r}")
            m, tile = entry
            if not is_int(m) or m < 1:
                raise bad(where, f"has m={m!r}; it must be an integer >= 1")
            if not is_int(tile) or tile not in tiles:
                raise bad(where, f"has tile_m={tile!r}; it must be one of {tiles}")
    return table


def _device_kind() -> str | None:
    try:
        dev = jax.devices()[0]
    except RuntimeError:
        return None
    return dev.device_kind if dev.platform == "gpu" else None


def group_gemm_tile_m(m: int, experts: int, n: int, k: int, dtype, tile_m=None) -> int:
    """tile_m for a group_gemm of m rows, w (experts, n, k): the caller's
    choice when given, else the table entry whose m is nearest (log scale),
    else default_tile_m; an answer of 128 becomes 256 where the sm90 kernel
    applies, and an answer of 8 becomes 16 where the TMA decode kernel does
    (see the module docstring). Trace-time only: no device work."""
    if tile_m is not None:
        return _checks.tile_m(tile_m)
    sm90 = sm90_usable(n, k, dtype)
    tma = tma_decode_usable(k, dtype)
    kind = _device_kind()
    entries = load_table(kind).get(table_key(experts, n, k, dtype)) if kind else None
    if entries and m > 0:
        tile = int(min(entries, key=lambda e: abs(math.log2(max(e[0], 1)) - math.log2(m)))[1])
        if tile == 128 and sm90 and m / max(experts, 1) > DECODE_MAX_ROWS:
            return SM90_TILE
        if tile == 8 and tma:
            return TMA_TILE
        return tile
    return default_tile_m(m, experts, sm90=sm90, tma=tma)
