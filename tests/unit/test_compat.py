"""Every private vLLM name the package touches (``integration/vllm_api.py``'s
``REGISTRY``) against the installed vLLM: every target resolves
(``vllm-cp-kv compat``); a moved target, a renamed method and a renamed
keyword argument are reported; the module's table lists every item; and
the package's imports run one way (no circle; nothing imports the
installer ``plugin.py``)."""

import ast
import os
import re
import subprocess
import sys

from conftest import ROOT, needs_vllm

pytestmark = needs_vllm


def test_every_registry_target_resolves_in_the_installed_vllm():
    from vllm_cp_kv.integration.vllm_api import REGISTRY, applies
    from vllm_cp_kv.tools.compat import check_all

    report = check_all()
    # the CPU build: items 1-26 and the tests' 29 (27, 28: GPU, 0.33+)
    assert sorted(report) == sorted({item.no for item in REGISTRY if applies(item)}) \
        == [*range(1, 27), 29]
    assert {no: p for no, p in report.items() if p} == {}


def test_each_release_and_build_sees_its_own_spelling_of_an_item():
    """An item whose names differ between releases is listed once per
    spelling (18: the builder's method on 0.32, a module function from 0.33,
    with the sliding window on 0.34; 21: the runner choice up to 0.33), and
    CPU-build items (6, 22) apply to the CPU build only, 27 (TRITON_MLA's
    profile-run reservation) to 0.33+ GPU wheels only, 28 (the shard-aware
    sparse path) to 0.34 GPU wheels only, 29 (the tests' fork of CPU
    workers) to the CPU build only: every release and build sees each of
    items 1-29 at most once, and all of those its build has."""
    from vllm_cp_kv.integration.vllm_api import KNOWN_VLLM, REGISTRY, applies

    seen = {}
    for release in KNOWN_VLLM:
        for build in ("cpu", "gpu"):
            items = [item for item in REGISTRY if applies(item, release, build)]
            numbers = sorted({item.no for item in items})
            seen[release, build] = [n for n in range(1, 30) if n not in numbers]
            spelled = {}
            for item in items:  # one entry per item number, except 21's two halves
                spelled.setdefault(item.no, []).append(item)
            assert all(len(v) == 1 for no, v in spelled.items() if no not in (21,))
    assert seen[(0, 32), "cpu"] == [27, 28] and seen[(0, 32), "gpu"] == [6, 22, 27, 28, 29]
    assert seen[(0, 33), "gpu"] == [6, 22, 28, 29]
    assert seen[(0, 34), "gpu"] == [6, 14, 22, 29]
    eighteen = [item for item in REGISTRY if item.no == 18]
    assert [item.releases for item in eighteen] == [((0, 32),), ((0, 33),), ((0, 34),)]
    assert all(item.why for item in REGISTRY if item.releases or item.build)


def test_the_other_releases_spelling_is_reported_moved_here():
    """Checked as if the installed vLLM (0.32) were 0.34, 0.34's spellings
    (item 18's module function, no runner choice) do not resolve: the check
    reads the installed vLLM, not the registry's word."""
    from vllm_cp_kv.tools.compat import check_all

    report = check_all(release=(0, 34), build="gpu")
    assert report[18] and "_reserve_attn_logits_workspace" in report[18][0]
    assert not report[21]  # 21's common half resolves on 0.32 too


def test_a_moved_target_a_renamed_parameter_and_a_dropped_field_are_reported():
    from vllm_cp_kv.integration.vllm_api import Rebinding
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


def test_a_renamed_method_and_a_renamed_keyword_of_vllm_are_reported(monkeypatch):
    """What an upgrade of vLLM could do to the names the plugin overrides and
    calls: ``_compute_prefill_context`` renamed (the sharded impl's override
    would silently stop being called) and a keyword of ``_build_decode``
    renamed (the shard-aware decode's call would fail, or pass a keyword
    vLLM no longer reads). Both are reported by the registry's items."""
    from vllm.model_executor.layers.attention import mla_attention as mla

    from vllm_cp_kv.tools.compat import check_all

    impl, builder = mla.MLACommonBaseImpl, mla.MLACommonMetadataBuilder
    monkeypatch.setattr(impl, "_compute_context_chunks", impl._compute_prefill_context,
                        raising=False)
    monkeypatch.delattr(impl, "_compute_prefill_context")

    def _build_decode(self, block_table_tensor, seq_lens, max_seq_len, query_start_loc_cpu,
                      query_start_loc_device, num_decode_tokens, max_query_len,
                      dcp_tot_seq_lens_device):
        return None

    monkeypatch.setattr(builder, "_build_decode", _build_decode)
    report = check_all()
    assert any("_compute_prefill_context" in p for p in report[16]), report[16]
    assert any("seq_lens_device" in p for p in report[17]), report[17]
    assert all(not p for no, p in report.items() if no not in (16, 17))


def test_the_api_table_lists_every_registry_item():
    from vllm_cp_kv.integration import vllm_api

    lines = vllm_api.__doc__.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("=====")]
    table = "\n".join(lines[rules[1] + 1: rules[2]])
    numbers = [int(n) for n in re.findall(r"^(\d+)\s", table, re.M)]
    assert numbers == sorted({item.no for item in vllm_api.REGISTRY})


def test_the_command_line_reports_every_item_ok():
    from vllm_cp_kv.integration.vllm_api import REGISTRY

    out = subprocess.run([sys.executable, "-m", "vllm_cp_kv.tools.cli", "compat"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    from vllm_cp_kv.integration.vllm_api import applies

    # the CPU build: every item 1-26 in 0.32's spelling (21 in two entries)
    # and the tests' 29
    assert out.stdout.count(": ok") == sum(map(applies, REGISTRY)) == 28
    assert "MOVED" not in out.stdout and len({item.no for item in REGISTRY}) == 29


def package_imports() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at the top, inside a
    function or under ``TYPE_CHECKING``), read from the source."""
    root = os.path.join(ROOT, "vllm_cp_kv")
    mods = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = path
    edges = {}
    for name, path in mods.items():
        package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
        found = set()
        tree = ast.parse(open(path).read())
        # ``if TYPE_CHECKING:`` imports count too (annotations only, but a
        # circle of types is still a circle to a reader)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] \
                    if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found |= {n for n in names if n in mods and n != name
                      and n not in ("vllm_cp_kv", "vllm_cp_kv.integration")}
        edges[name] = found
    return edges


def cycles(edges) -> list[list[str]]:
    """Strongly connected components of more than one module."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def test_the_package_imports_run_one_way():
    edges = package_imports()
    assert cycles(edges) == []
    # nothing imports the installer but the entry point (vllm_cp_kv.register);
    # the vLLM API module imports nothing of the package
    assert [m for m, e in edges.items()
            if "vllm_cp_kv.integration.plugin" in e] == ["vllm_cp_kv"]
    assert edges["vllm_cp_kv.integration.vllm_api"] <= set()
    # the vLLM-independent core imports nothing of the integration layer
    assert all(not any(t.startswith("vllm_cp_kv.integration") for t in e)
               for m, e in edges.items() if m.startswith("vllm_cp_kv.core"))


def test_the_import_check_finds_a_circle():
    """Negative control: a made-up back edge from the per-step types to the
    planning module (which imports them) is a circle."""
    edges = package_imports()
    edges["vllm_cp_kv.integration.step"].add("vllm_cp_kv.integration.planning")
    assert ["vllm_cp_kv.integration.planning", "vllm_cp_kv.integration.step"] in cycles(edges)


def test_the_per_step_types_are_a_leaf():
    """``integration/step.py`` (the plan, the step context, the decode view
    and buffers) imports only the core: every module may read them."""
    edges = package_imports()
    assert all(t.startswith("vllm_cp_kv.core") for t in edges["vllm_cp_kv.integration.step"])


def test_no_function_over_80_lines():
    """Every function and method of the package fits 80 lines (a negative
    control: the check finds a made-up long one)."""

    def long_ones(source, path):
        return [(path, n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and n.end_lineno - n.lineno + 1 > 80]

    found = []
    for dirpath, _, files in os.walk(os.path.join(ROOT, "vllm_cp_kv")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                found += long_ones(open(path).read(), os.path.relpath(path, ROOT))
    assert found == []
    assert long_ones("def f():\n" + "    x = 1\n" * 80, "made-up") == [("made-up", "f", 81)]


def module_state(source: str) -> set[str]:
    """Module-level names of ``source`` that a function rebinds (``global``)
    or that hold a mutable container."""
    tree = ast.parse(source)
    rebound = {name for n in ast.walk(tree) if isinstance(n, ast.Global) for name in n.names}
    mutable = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
    found = set()
    for n in tree.body:
        targets = [n.target] if isinstance(n, ast.AnnAssign) else getattr(n, "targets", [])
        value = getattr(n, "value", None)
        container = isinstance(value, mutable) or (
            isinstance(value, ast.Call) and getattr(value.func, "id", "") in ("dict", "list", "set"))
        found |= {t.id for t in targets if isinstance(t, ast.Name)
                  and (t.id in rebound or container)}
    return found


def test_every_module_global_is_documented():
    """docs/design.md's module-state list and its tables are every
    module-level state of the package (negative control: a made-up one is
    found)."""
    found = set()
    for dirpath, _, files in os.walk(os.path.join(ROOT, "vllm_cp_kv")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.join(ROOT, "vllm_cp_kv"))
                found |= {f"{rel}:{name}" for name in module_state(open(path).read())}
    doc = open(os.path.join(ROOT, "docs", "design.md")).read()
    section = doc[doc.index("**Module state.**"):doc.index("The per-step types")]
    listed = {f"{path}:{name}" for path, name in re.findall(r"`([\w/]+\.py):(\w+)`", section)}
    assert found == listed, (found - listed, listed - found)
    assert module_state("X = {}\nY = None\nZ = 2\ndef f():\n    global Y\n    Y = 1\n") == {"X", "Y"}


# What puts a test module out of tests/unit (tests/conftest.py, the folder
# rule): a vLLM engine started, or a group of processes
ENGINE = ("run_generate(", "harness_env(", "vllm serve", "tools.pd_offline")
PROCESSES = ("spawn_ranks(", "init_process_group(", "Popen(", "mutation_check")
FOLDERS = ("unit", "distributed", "vllm", "pd")


def _needs(path) -> set:
    text = open(path).read()
    return {m for m in ENGINE + PROCESSES if m in text}


def test_the_test_folders_follow_their_rule():
    """Every test module is in one of the folders (tests/conftest.py), its
    name unique (pytest's default import mode); ``-m quick`` is exactly
    tests/unit; no module there starts a vLLM engine or a group of
    processes, and none in tests/distributed an engine. Negative controls:
    an engine module and a process-group module are found."""
    from conftest import in_fast_tier

    tests = os.path.join(ROOT, "tests")
    found = {}
    for dirpath, _, files in os.walk(tests):
        for f in files:
            if f.startswith("test_") and f.endswith(".py"):
                found.setdefault(f, []).append(os.path.relpath(dirpath, tests))
    assert {f: d for f, d in found.items() if len(d) > 1} == {}
    assert {f: d[0] for f, d in found.items() if d[0] not in FOLDERS} == {}
    assert {d[0] for d in found.values()} == set(FOLDERS)
    for f, (folder,) in found.items():
        path = os.path.join(tests, folder, f)
        assert in_fast_tier(path) == (folder == "unit"), path
        if folder == "unit" and f != os.path.basename(__file__):  # this file names them
            assert not _needs(path), (path, _needs(path))
        if folder == "distributed":
            assert not _needs(path) & set(ENGINE), (path, _needs(path))
    assert _needs(os.path.join(tests, "vllm", "test_e2e_vllm.py")) & set(ENGINE)
    assert _needs(os.path.join(tests, "distributed", "test_materialize_dist.py")) & set(PROCESSES)
