"""A quick share of the mutation check (``scripts/mutation_check.py``,
``harness/mutations.py``): each mutation breaks one guard of this round's
work in a copy of the tree and the test that guards it must fail; every
listed mutation's text must still be in its file (a stale entry fails here,
instead of silently not running)."""

import os
import subprocess
import sys

import pytest

from conftest import ROOT, needs_vllm
from harness.mutations import MUTATIONS, QUICK

pytestmark = needs_vllm


def test_every_mutation_still_finds_its_target():
    for path, old, _, tests in MUTATIONS:
        with open(os.path.join(ROOT, path)) as f:
            assert old in f.read(), (path, old)
        for t in tests.split():
            assert os.path.exists(os.path.join(ROOT, t.split("::")[0])), t


@pytest.mark.parametrize("index", QUICK)
def test_a_mutation_makes_its_guard_fail(index):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "mutation_check.py"),
                          str(index)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "FAILS (good)" in out.stdout
