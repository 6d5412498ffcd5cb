"""Break one guarded thing at a time in a copy of the tree and confirm the
test that guards it fails (the tests' own negative controls aside).

Usage: bash -c 'source scripts/cpu_env.sh && .venv/bin/python scripts/mutation_check.py [N ...]'
The mutations are ``harness/mutations.py`` (``N``: only those, by index).
Prints one line per mutation: "FAILS (good)", "PASSES (BAD)", or "STALE"
(its text is no longer in the file: the guard moved; the entry needs
updating). Every mutation runs, whatever the others do; exit status 1 if
any passes or is stale. No vLLM engine starts (modules of tests/unit and
tests/distributed only; a few minutes on 2 cores).
"""
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, HERE)
from harness.mutations import MUTATIONS  # noqa: E402


def copy_tree() -> str:
    root = tempfile.mkdtemp(prefix="cpkv-mutations-")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=HERE,
                           capture_output=True, text=True, check=True).stdout.split()
    subprocess.run(["tar", "-cf", os.path.join(root, "tree.tar"), *files], cwd=HERE,
                   check=True)
    subprocess.run(["tar", "-xf", "tree.tar"], cwd=root, check=True)
    return root


def run(index: int, root: str) -> str:
    """``"FAILS"``, ``"PASSES"`` or ``"STALE"`` for mutation ``index``."""
    path, old, new, test = MUTATIONS[index]
    p = os.path.join(root, path)
    src = open(p).read()
    if old not in src:
        print(f"STALE        | {index} {path}: {old[:60]!r} is gone", flush=True)
        return "STALE"
    open(p, "w").write(src.replace(old, new, 1))
    try:
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p",
                            "no:cacheprovider", *test.split()], cwd=root,
                           env={**os.environ, "PYTHONPATH": root}, capture_output=True,
                           text=True, timeout=600)
    finally:
        open(p, "w").write(src)
    last = [line for line in r.stdout.splitlines()
            if "passed" in line or "failed" in line or "error" in line][-1:]
    verdict = "FAILS" if r.returncode else "PASSES"
    print(f"{'FAILS (good)' if r.returncode else 'PASSES (BAD)'} | {index} {path}: "
          f"{new[:60]!r} | {test} | {last}", flush=True)
    return verdict


def main(indices) -> int:
    root = copy_tree()
    verdicts = [run(i, root) for i in indices]
    return 0 if all(v == "FAILS" for v in verdicts) else 1


if __name__ == "__main__":
    picked = [int(a) for a in sys.argv[1:]] or range(len(MUTATIONS))
    sys.exit(main(picked))
