"""Compares the kernels of two sets of PTX files, whichever file each lives in.

    python3 tools/ptx_diff.py --old OLD.ptx [...] --new NEW.ptx [...]

Shows that a move of device code kept it: every .entry (and .func) of the
old files must appear in the new ones with the same body. Names are compared
demangled, with what a move changes normalised away: anonymous-namespace ids
and of function-local statics (both embed the file name), the enum type of a dtype template argument
(xla::ffi::DataType and jax_moe::DType carry the same values), and the
per-file numbering of basic-block labels and local depots. Generate the PTX
without -lineinfo (line info names files and lines). Exit status 1 when an
old function is missing or differs.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

_MANGLED = re.compile(r"_Z[\w$]+")
_PARAM = re.compile(r"^(.*?)(_param_\d+)$")
_FUNC_START = re.compile(r"^(?:\.visible |\.weak )?\.(entry|func)\b")
_NORMALISE = [
    (re.compile(r"_GLOBAL__N__\w+?_[0-9a-f]{8}(?=::|\b)"), "(anon)"),
    (re.compile(r"\(xla::ffi::DataType\)|\(jax_moe::DType\)"), "(DType)"),
    (re.compile(r"xla::ffi::DataType|jax_moe::DType"), "DType"),
]
_LOCAL = [  # applied to the whole text: function-local statics are not _Z names
    (re.compile(r"\d*_INTERNAL_[0-9a-f]{8}_\d+_\w+?_[0-9a-f]{8}"), "_INTERNAL_"),
    (re.compile(r"\d+_GLOBAL__N__[0-9a-f]{8}_\d+_\w+?_[0-9a-f]{8}"), "_ANON_"),
    (re.compile(r"\$L__BB\d+_"), "$L__BB_"),
    (re.compile(r"__local_depot\d+"), "__local_depot"),
]


def _demangle(names: list[str]) -> dict[str, str]:
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.split("\n")
    result = {}
    for name, plain in zip(names, out):
        for pattern, repl in _NORMALISE:
            plain = pattern.sub(repl, plain)
        result[name] = plain
    return result


def _functions(paths: list[str]) -> dict[str, tuple[str, str]]:
    """{normalised name: (kind, normalised body)} over the files."""
    blocks = []
    for path in paths:
        lines = open(path).read().split("\n")
        i = 0
        while i < len(lines):
            m = _FUNC_START.match(lines[i])
            if not m:
                i += 1
                continue
            j = i  # the signature runs to "{" (a definition) or ";" (a declaration)
            while j < len(lines) and lines[j].strip() != "{" and not lines[j].endswith(";"):
                j += 1
            if j >= len(lines) or lines[j].endswith(";"):
                i = j + 1
                continue
            while j < len(lines) and lines[j] != "}":
                j += 1
            blocks.append((m.group(1), "\n".join(lines[i:j + 1]), path))
            i = j + 1
    tokens = sorted({t for _, body, _ in blocks for t in _MANGLED.findall(body)})
    bases = sorted({(_PARAM.match(t).group(1) if _PARAM.match(t) else t) for t in tokens})
    plain = _demangle(bases) if bases else {}

    def norm(token: str) -> str:
        m = _PARAM.match(token)
        base, suffix = (m.group(1), m.group(2)) if m else (token, "")
        return "<" + plain[base] + ">" + suffix

    result = {}
    for kind, body, path in blocks:
        text = _MANGLED.sub(lambda mm: norm(mm.group(0)), body)
        for pattern, repl in _LOCAL:
            text = pattern.sub(repl, text)
        head = text.split("\n", 1)[0]
        name = re.search(r"<(.*)>\(?\s*$", head)
        key = name.group(1) if name else head
        if key in result and result[key][1] != text:
            print(f"warning: {kind} {key} has two bodies in the new set ({path})", file=sys.stderr)
        result[key] = (kind, text)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", nargs="+", required=True)
    parser.add_argument("--new", nargs="+", required=True)
    args = parser.parse_args(argv)
    old, new = _functions(args.old), _functions(args.new)
    same = [k for k in old if k in new and new[k][1] == old[k][1]]
    differ = [k for k in old if k in new and new[k][1] != old[k][1]]
    missing = [k for k in old if k not in new]
    added = [k for k in new if k not in old]
    kinds = lambda keys, table: sum(table[k][0] == "entry" for k in keys)  # noqa: E731
    print(f"old: {len(old)} functions ({kinds(old, old)} kernels); new: {len(new)} "
          f"({kinds(new, new)} kernels)")
    print(f"identical: {len(same)}; differ: {len(differ)}; missing from new: {len(missing)}; "
          f"only in new: {len(added)}")
    for label, keys in (("DIFFERS", differ), ("MISSING", missing), ("NEW", added)):
        for k in keys:
            print(f"  {label}: {k[:200]}")
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main())
