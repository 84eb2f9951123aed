"""tools/gpu_check.sh's sharded stage, run on stub commands.

The script is for GPU machines; here `nvidia-smi` and `python3` are stubs
first on PATH (the first lists N GPUs, the second logs its arguments and
exits 0), so the test sees the commands the stage would run for a GPU count,
and that it fails where there are fewer than two GPUs.
"""

import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "gpu_check.sh"


def run_sharded_stage(tmp_path, gpus: int):
    """(exit status, the stub python3's argument lines, summary.txt)."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    log = tmp_path / "python3_calls.log"
    gpu_lines = "".join(f'echo "GPU {i}: stub"\n' for i in range(gpus))
    (stubs / "nvidia-smi").write_text("#!/bin/bash\n" + gpu_lines)
    (stubs / "python3").write_text(f'#!/bin/bash\necho "$*" >> "{log}"\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
           "SANITIZE_FILES": " "}  # no sanitizer runs: only the stage matters here
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(SCRIPT), str(out), "sharded"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    calls = log.read_text().splitlines() if log.exists() else []
    return done.returncode, calls, (out / "summary.txt").read_text()


def calls_of(calls, script):
    return [c for c in calls if script in c.split()]


@pytest.mark.parametrize("gpus, counts", [(8, "2 4 8"), (4, "2 4"), (2, "2")])
def test_sharded_stage_uses_every_gpu(tmp_path, gpus, counts):
    status, calls, summary = run_sharded_stage(tmp_path, gpus)
    assert status == 0, summary
    (tests,) = calls_of(calls, "tests/layer/test_parallel.py")
    assert "tests/property/test_prop_parallel.py" in tests.split()
    forward, train = calls_of(calls, "benchmarks/bench_sharded.py")
    assert f"--device-counts {counts} --json" in forward and "--train" not in forward.split()
    assert f"--device-counts {counts} --train --json" in train
    assert forward.split()[-1].endswith("bench_sharded_forward.json")
    assert train.split()[-1].endswith("bench_sharded_train.json")
    (example,) = calls_of(calls, "examples/multiprocess_moe.py")
    assert f"--gpus {gpus} " in example
    assert f"multiprocess ({gpus} GPUs): exit 0" in summary


def test_sharded_stage_fails_on_one_gpu(tmp_path):
    status, calls, summary = run_sharded_stage(tmp_path, 1)
    assert status == 1
    assert "sharded: exit 1" in summary
    assert not calls_of(calls, "benchmarks/bench_sharded.py")
    assert not calls_of(calls, "examples/multiprocess_moe.py")
