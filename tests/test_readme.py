"""The README's quickstart runs as pasted.

The code block is the first ```python block after the "## Quickstart" heading
of README.md. It runs unchanged in a fresh Python process on the CPU
(JAX_PLATFORMS=cpu), against the jax_moe that this test process imports, and
must exit 0; its own asserts check the results.
"""

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def quickstart_code(text: str) -> str:
    """The first ```python block after the "## Quickstart" heading."""
    heading = re.search(r"^## Quickstart\s*$", text, re.MULTILINE)
    assert heading, "README.md has no '## Quickstart' heading"
    block = re.compile(r"^```python\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL).search(
        text, heading.end())
    assert block, "README.md has no ```python block after '## Quickstart'"
    return block.group(1)


def test_quickstart_code_is_found():
    code = quickstart_code(README.read_text(encoding="utf-8"))
    assert "import jax_moe" in code and "moe_forward" in code


def test_quickstart_runs_as_pasted(tmp_path):
    code = quickstart_code(README.read_text(encoding="utf-8"))
    script = tmp_path / "quickstart.py"
    script.write_text(code, encoding="utf-8")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # The jax_moe this process imports (an installed package or PYTHONPATH=src).
    spec = importlib.util.find_spec("jax_moe")
    assert spec is not None and spec.origin, "jax_moe is not importable"
    root = str(pathlib.Path(spec.origin).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (
        f"the README quickstart exited {proc.returncode}\n"
        f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
    assert proc.stdout.strip().startswith("ok"), proc.stdout
