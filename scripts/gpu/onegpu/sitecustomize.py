"""Loads ``patches.py`` in every Python process started with this folder on
PYTHONPATH (vLLM's spawned workers too), when one of its switches is set
(``ONEGPU=1``, ``ONEGPU_CPU_COMM=1``, ``CPKV_SHIM_DECODE_THRESHOLD=K``,
``CPKV_TEST_HOOKS=1``). Not part of the package: the one-GPU harness, its
verification shims and the P/D test hooks.

Any other sitecustomize.py later on sys.path (this one shadows it) runs too.
"""

import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _chain_other_sitecustomize() -> None:
    for p in sys.path:
        d = os.path.abspath(p or os.getcwd())
        cand = os.path.join(d, "sitecustomize.py")
        if d != _HERE and os.path.isfile(cand):
            spec = importlib.util.spec_from_file_location("_chained_sitecustomize", cand)
            mod = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(mod)
            except Exception as e:  # never break interpreter start-up
                sys.stderr.write(f"onegpu: chained {cand} failed: {e!r}\n")
            return


if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
try:
    import patches

    patches.install()
except Exception as e:  # report, never break interpreter start-up
    sys.stderr.write(f"onegpu: patch install failed: {e!r}\n")
_chain_other_sitecustomize()
