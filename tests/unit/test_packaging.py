"""``pip install`` / a wheel installs what users meet: the vLLM plugin entry
point (``vllm.general_plugins``) and the ``vllm-cp-kv`` console script (its
capacity figures against the engine's: tests/vllm/test_e2e_vllm.py)."""

import os
import re
import shutil
import subprocess
import sys
import zipfile

from conftest import ROOT


def test_wheel_metadata(tmp_path):
    # from a copy without the checkout's ignored build outputs: setuptools'
    # build/lib keeps modules since deleted, which a clean checkout lacks
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".work", ".s[0-9][0-9]", "build", "*.egg-info", "__pycache__",
        ".pytest_cache"))
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    wheel = next(p for p in os.listdir(tmp_path) if p.endswith(".whl"))
    with zipfile.ZipFile(tmp_path / wheel) as z:
        names = z.namelist()
        entry = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert re.search(r"\[vllm\.general_plugins\]\s*\ncp_kv = vllm_cp_kv:register", entry)
    assert re.search(r"\[console_scripts\]\s*\nvllm-cp-kv = vllm_cp_kv\.tools\.cli:main",
                     entry)
    # the shipped package carries no test code: no tests, no harness (the
    # vLLM driver, references, loopback owners), no P/D test hooks
    assert not [n for n in names if n.startswith(("tests/", "harness/", "scripts/"))]
    assert "vllm_cp_kv/tools/loopback.py" not in names
    with zipfile.ZipFile(tmp_path / wheel) as z:
        hooked = [n for n in names if n.endswith(".py")
                  and re.search(rb"cp_kv_test_|TEST_HOOKS", z.read(n))]
    assert not hooked, hooked
    assert "vllm_cp_kv/integration/plugin.py" in names


def test_console_script_is_installed():
    script = os.path.join(os.path.dirname(sys.executable), "vllm-cp-kv")
    proc = subprocess.run([script, "capacity", "--help"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "--kv-memory-gib" in proc.stdout
