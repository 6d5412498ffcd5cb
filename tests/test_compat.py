"""The registry of vLLM rebindings (``integration/plugin.py``) against the
installed vLLM: every target resolves (``vllm-cp-kv compat``), a target
that moved is reported, and the module's table lists every item."""

import re
import subprocess
import sys

from conftest import needs_vllm

pytestmark = needs_vllm


def test_every_registry_target_resolves_in_the_installed_vllm():
    from vllm_cp_kv.tools.compat import check_all

    report = check_all()
    assert sorted(report) == list(range(1, len(report) + 1))
    assert {no: p for no, p in report.items() if p} == {}


def test_a_moved_target_a_renamed_parameter_and_a_dropped_field_are_reported():
    from vllm_cp_kv.integration.plugin import Rebinding
    from vllm_cp_kv.tools.compat import check_item

    moved = check_item(Rebinding(90, ("vllm.v1.attention.selector:_cached_get_attn_backend",
                                      "vllm.v1.attention.selector:no_such_function")))
    assert len(moved) == 1 and "no_such_function" in moved[0]
    gone = check_item(Rebinding(91, ("vllm.no_such_module:f",)))
    assert len(gone) == 1 and "ModuleNotFoundError" in gone[0]
    renamed = check_item(Rebinding(
        92, ("vllm.v1.attention.backends.mla.triton_mla:decode_attention_fwd",),
        params=("q", "no_such_parameter")))
    assert len(renamed) == 1 and "no_such_parameter" in renamed[0]
    dropped = check_item(Rebinding(93, ("vllm.v1.attention.backend:AttentionImplBase.__new__",),
                                   assigns=("dcp_world_size", "no_such_field")))
    assert len(dropped) == 1 and "no_such_field" in dropped[0]
    # a field compared (==), not assigned, does not count as assigned
    compared = check_item(Rebinding(94, ("vllm.v1.attention.backends.mla.triton_mla:"
                                         "TritonMLAImpl.__init__",),
                                    assigns=("dcp_world_size",)))
    assert compared and "dcp_world_size" in compared[0]


def test_the_plugin_docstring_table_lists_every_registry_item():
    from vllm_cp_kv.integration import plugin

    rules = [i for i, line in enumerate(plugin.__doc__.splitlines())
             if line.startswith("=====")]
    table = "\n".join(plugin.__doc__.splitlines()[rules[1] + 1: rules[2]])
    numbers = [int(n) for n in re.findall(r"^(\d+)\s", table, re.M)]
    assert numbers == [item.no for item in plugin.REGISTRY]


def test_the_command_line_reports_every_item_ok():
    out = subprocess.run([sys.executable, "-m", "vllm_cp_kv.tools.cli", "compat"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count(": ok") == 15
