"""Loads the compiled extension and registers every FFI target once."""

from __future__ import annotations

import functools

import jax

try:
    from jax_moe import _jax_moe as _ext
except ImportError as exc:  # pragma: no cover - only when the build is missing
    raise ImportError(
        "jax_moe's compiled extension (_jax_moe) is missing: install the package "
        "with `pip install --no-build-isolation .` so that it is built against "
        "the installed jax"
    ) from exc

INDEX_CHUNK: int = int(_ext.INDEX_CHUNK)
HAS_CUDA: bool = bool(_ext.has_cuda)
# The CUTLASS sm90 grouped GEMM (group_gemm's tile_m=256) was built: CUDA on
# and CUTLASS's headers (the nvidia-cutlass wheel) present at build time.
HAS_SM90_GEMM: bool = bool(getattr(_ext, "HAS_SM90_GEMM", False))
# Experts averaging at most this many rows run tile_m=256 on the own Hopper
# kernel instead of CUTLASS's, and the forward-only layer fuses the w13 GEMM
# with the activation (kernels/common/wgmma_rule.h).
WGMMA_MAX_AVG_ROWS: int = int(_ext.WGMMA_MAX_AVG_ROWS)


@functools.cache
def register() -> None:
    """Registers every target for each platform the extension was built for."""
    for platform, targets in _ext.registrations().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)


register()
