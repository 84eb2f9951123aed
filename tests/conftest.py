"""Test configuration shared by the whole suite.

Runs unchanged on CPU (``JAX_PLATFORMS=cpu`` or unset) and on a GPU
(``JAX_PLATFORMS=cuda``): every op test runs on the default backend, and the
GPU-only tests (marked ``gpu``) compare the CUDA handlers with the CPU ones.

Each test gets a fresh random seed; a failing test prints it in a
"jax_moe seed" section. Re-run with ``JAX_MOE_SEED=<seed>`` to reproduce.

Layout: the tests of one step each are in ops/, the layer-level ones in
layer/, attention's in attention/, the benchmark scripts' in bench/; the
helpers they share (common.py, oracle.py, attention_cases.py) and this file
are here, at the root of tests/, which is put on sys.path below so that every
subfolder imports them by name. The folders are not packages (no
__init__.py): test file names must be unique across the whole suite.
"""

import os
import sys

# The shared helper modules (and `from conftest import ON_GPU`) import by name
# from every subfolder, whatever pytest's import mode.
_here = os.path.dirname(os.path.abspath(__file__))
if _here not in sys.path:
    sys.path.insert(0, _here)

# --- environment, before jax is imported anywhere -------------------------
# 8 host devices for shard_map tests (appended to any user flags).
_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()

# With JAX_PLATFORMS=cuda jax would not start its CPU backend at all, and the
# GPU-vs-CPU tests need it. Appending "cpu" keeps cuda first, so it stays the
# default backend.
_platforms = os.environ.get("JAX_PLATFORMS", "")
if _platforms and "cpu" not in _platforms.split(","):
    os.environ["JAX_PLATFORMS"] = _platforms + ",cpu"

# On a GPU jax would otherwise preallocate 75% of the GPU's memory in every
# pytest process, more than parallel pytest-xdist workers can share. A user's
# own setting wins. No effect on CPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import secrets  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The reference backend's f32 GEMMs (lax.ragged_dot) would otherwise run in
# TF32 on NVIDIA GPUs (~1e-3 relative error), too coarse for the f32
# tolerance of 1e-5 that the kernels are held to. No effect on CPU.
jax.config.update("jax_default_matmul_precision", "highest")

ON_GPU = jax.default_backend() == "gpu"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (skipped elsewhere)")
    config.addinivalue_line(
        "markers", "sanitize: small edge cases run under compute-sanitizer "
                   "(tools/gpu_check.sh sanitize: pytest -m sanitize)")


def pytest_collection_modifyitems(config, items):
    if ON_GPU:
        return
    skip = pytest.mark.skip(reason="needs a GPU (jax.default_backend() != 'gpu')")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def seed(request):
    """A fresh seed per test (or JAX_MOE_SEED), reported when the test fails."""
    value = int(os.environ.get("JAX_MOE_SEED") or secrets.randbits(32))
    request.node._jax_moe_seed = value
    return value


@pytest.fixture
def rng(seed):
    """numpy Generator seeded from ``seed``: all test inputs are drawn from it."""
    return np.random.default_rng(seed)


@pytest.fixture
def key(seed):
    """A jax PRNG key from the same seed, for tests that prefer jax.random."""
    return jax.random.key(seed)


@pytest.fixture
def on_gpu():
    return ON_GPU


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seed_value = getattr(item, "_jax_moe_seed", None)
    if report.failed and seed_value is not None:
        report.sections.append(
            ("jax_moe seed", f"seed={seed_value}  (reproduce: JAX_MOE_SEED={seed_value} pytest {item.nodeid!r})"))
