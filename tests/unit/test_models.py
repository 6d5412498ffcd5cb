"""The table of MLA architectures (vllm_cp_kv/integration/models.py,
docs/models.md) against the installed vLLM's registry: every architecture
whose model code holds MLA (its module names vLLM's MLA layer or cache
spec) has a row, or is listed as not MLA with why; docs/models.md names
every architecture with its status. The refusals themselves are the
arch-* rows of tests/unit/test_startup_checks.py."""

import os
import re

from conftest import ROOT, needs_vllm

pytestmark = needs_vllm
# vLLM's MLA layer or cache spec named, or DeepSeek-V2's model code reused
# (the VL, OCR and other models built on its MLA decoder layers)
MLA_CODE = re.compile(r"\bMLAAttention\b|MultiHeadLatentAttention|MLAAttentionSpec"
                      r"|deepseek_v2 import")


def module_files(vllm_dir: str, module: str) -> list[str]:
    """The source files of a registry entry's module: a file or package of
    vllm/model_executor/models, or (named ``vllm.models...``) under vllm/."""
    if module.startswith("vllm."):
        path = os.path.join(os.path.dirname(vllm_dir), *module.split("."))
    else:
        path = os.path.join(vllm_dir, "model_executor", "models", module)
    if os.path.isdir(path):
        return [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
                if f.endswith(".py")]
    return [path + ".py"] if os.path.exists(path + ".py") else []


def mla_architectures() -> set[str]:
    import vllm
    from vllm.model_executor.models import registry

    vllm_dir = os.path.dirname(vllm.__file__)
    found = set()
    for arch, (module, _) in registry._VLLM_MODELS.items():
        if module == "transformers":  # the Transformers backend: its MLA fuser
            continue  # serves any config with kv_lora_rank, under a name not in
            # the table, so refused as unverified (test_row_arch_unverified)
        for path in module_files(vllm_dir, module):
            with open(path) as f:
                if MLA_CODE.search(f.read()):
                    found.add(arch)
                    break
    return found


def test_every_mla_architecture_of_the_registry_has_a_row():
    from vllm_cp_kv.integration.models import ARCHITECTURES, NOT_MLA

    found = mla_architectures()
    assert {"DeepseekV2ForCausalLM", "DeepseekV32ForCausalLM"} <= found  # the scan finds
    missing = sorted(found - set(ARCHITECTURES) - set(NOT_MLA))
    assert not missing, f"MLA code without a row in models.FAMILIES or NOT_MLA: {missing}"
    assert not set(ARCHITECTURES) & set(NOT_MLA)


def test_the_docs_name_every_architecture_with_its_status():
    from vllm_cp_kv.integration.models import FAMILIES, NOT_MLA

    with open(os.path.join(ROOT, "docs", "models.md")) as f:
        text = f.read()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0].startswith("`") and cells[0].endswith("`"):
            rows[cells[0].strip("`")] = cells
    for fam in FAMILIES:
        for arch in fam.archs:
            assert arch in rows, arch
            assert rows[arch][1] == fam.name and rows[arch][2] == fam.status, rows[arch]
    for arch in NOT_MLA:
        assert arch in text, arch
