"""Runs the `sanitize`-marked tests of one test file under compute-sanitizer,
surviving the sanitizer's host-process crashes.

compute-sanitizer has crashed its host process (segfault, no report) in the
middle of JAX test runs several times, at different tests each time. This
driver runs the file's sanitize tests in one process; after a crash it runs
the test that was running alone in a fresh process, then goes on with the
rest. Exit 0 only when every test passed and no report has an error.

    python3 tools/run_sanitizer.py memcheck tests/attention/test_paged_decode.py LOGDIR
(jax_moe installed, or PYTHONPATH pointing at the built package; SANITIZE_K,
if set, is a pytest -k expression narrowing the sanitize tests). Each
sanitizer process logs to LOGDIR/<tool>_<test file>.<run>.log.
tools/gpu_check.sh runs it over every file with `sanitize` marks.
"""
import os
import re
import subprocess
import sys

tool, test_file, log_dir = sys.argv[1], sys.argv[2], os.path.abspath(sys.argv[3])
# pytest reports test ids relative to its rootdir (the repository root, where
# pyproject.toml is): run every pytest there.
root = os.path.dirname(os.path.abspath(test_file))
while root != "/" and not os.path.exists(os.path.join(root, "pyproject.toml")):
    root = os.path.dirname(root)
test_file = os.path.relpath(os.path.abspath(test_file), root)
env = dict(os.environ, JAX_PLATFORMS="cuda",
           # Plain launches (no CUDA graphs), and one cudaMalloc per buffer, so
           # that memcheck checks each buffer's own bounds (the default BFC
           # allocator carves buffers out of one large allocation).
           XLA_FLAGS="--xla_gpu_autotune_level=0 --xla_gpu_enable_command_buffer=",
           XLA_PYTHON_CLIENT_ALLOCATOR="platform")
BAD = re.compile(r"^========= (Invalid|Program hit|Error|Race|Warning: Race|Malformed|Out-of-range)"
                 r"|(ERROR|RACECHECK) SUMMARY: [1-9]", re.M)
# A test id may hold spaces (parametrize ids such as "[(1, 8, 2048)]").
OUTCOME = re.compile(r"^(\S+::.*?) (PASSED|FAILED|ERROR)(?= |$)", re.M)
runs = 0


def run(ids):
    """(exit code, {test id: outcome}, report had errors) of one sanitizer process."""
    global runs
    runs += 1
    log = os.path.join(log_dir, f"{tool}_{test_file.replace(os.sep, '_')}.{runs}.log")
    with open(log, "w") as fh:
        rc = subprocess.run(["compute-sanitizer", "--tool", tool, "--error-exitcode", "9",
                             sys.executable, "-X", "faulthandler", "-m", "pytest", "-v",
                             "-p", "no:cacheprovider", *ids],
                            stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=root).returncode
    text = open(log).read()
    outcomes = dict(OUTCOME.findall(text))
    print(f"{tool} {test_file} run {runs}: exit {rc}, {len(outcomes)}/{len(ids)} tests ran, "
          f"report {'with errors' if BAD.search(text) else 'clean'}", flush=True)
    return rc, outcomes, BAD.search(text) is not None

select = ["-k", os.environ["SANITIZE_K"]] if os.environ.get("SANITIZE_K") else []
collect = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                          "no:cacheprovider", "-m", "sanitize", *select, test_file],
                         capture_output=True, text=True, env=env, cwd=root)
if collect.returncode == 5:  # a file or -k expression that selects nothing: say so, not a failure
    print(f"{tool} {test_file}: no sanitize tests selected")
    sys.exit(0)
if collect.returncode != 0:
    print(f"{tool} {test_file}: collection failed\n"
          f"{collect.stdout[-2000:]}{collect.stderr[-2000:]}")
    sys.exit(1)
todo = [line.strip() for line in collect.stdout.splitlines() if "::" in line]
passed, failed, crashed, dirty = [], [], [], False
while todo:
    rc, outcomes, bad = run(todo)
    dirty |= bad
    passed += [t for t in todo if outcomes.get(t) == "PASSED"]
    failed += [t for t in todo if outcomes.get(t) in ("FAILED", "ERROR")]
    rest = [t for t in todo if t not in outcomes]
    if rc in (0, 1, 9) or not rest:  # the process ran to its end
        break
    cur, todo = rest[0], rest[1:]  # it crashed in `cur`: that test alone, then the rest
    rc, outcomes, bad = run([cur])
    dirty |= bad
    outcome = outcomes.get(cur)
    {"PASSED": passed, "FAILED": failed, "ERROR": failed}.get(outcome, crashed).append(cur)
print(f"{tool} {test_file}: {len(passed)} passed, {len(failed)} failed {failed}, "
      f"{len(crashed)} crashed twice {crashed}; reports {'WITH ERRORS' if dirty else 'clean'}")
sys.exit(0 if passed and not failed and not crashed and not dirty else 1)
