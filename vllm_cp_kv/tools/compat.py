"""``vllm-cp-kv compat``: resolve every private vLLM name the plugin
rebinds, overrides, calls or reads (``integration/vllm_api.py``'s
``REGISTRY``) against the installed vLLM, and say what moved.

    vllm-cp-kv compat [--json]

For each registry item: every target must import and resolve (a module
attribute, a class attribute, or a dataclass / pydantic field); the
parameters the plugin passes or overrides by name must be in the first
target's signature (``params``) and in each listed target's
(``signatures``); the instance fields the plugin reads or sets must still
be assigned (``self.<name> =`` in the source) by the first target
(``assigns``) or the listed one (``assigns_in``). Exit status 1 when
anything required moved. Run it against a new vLLM before upgrading.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re


def resolve(target: str):
    """The object ``"module:qualified.name"`` names (AttributeError or
    ImportError when it moved). A dataclass or pydantic field without a
    class default resolves to its field declaration."""
    module_name, _, qualname = target.partition(":")
    obj = importlib.import_module(module_name)
    parts = qualname.split(".")
    for i, part in enumerate(parts):
        try:
            obj = inspect.getattr_static(obj, part)
        except AttributeError:
            declared = _declared_fields(obj)
            if i == len(parts) - 1 and part in declared:
                return declared[part]
            raise AttributeError(f"{'.'.join(parts[:i]) or module_name} has no {part!r}")
    return obj


def _declared_fields(cls) -> dict:
    fields = {}
    for name in ("__dataclass_fields__", "model_fields", "__annotations__"):
        fields.update(getattr(cls, name, None) or {})
    return fields


def _function(obj):
    return getattr(obj, "__func__", obj)  # classmethod / staticmethod


def check_item(item) -> list[str]:
    """What moved for one :class:`~vllm_cp_kv.integration.vllm_api.Rebinding`
    (empty: everything resolves)."""
    problems, first = [], None
    for i, target in enumerate(item.targets):
        try:
            obj = resolve(target)
        except Exception as e:  # ImportError, AttributeError, ...
            problems.append(f"{target}: {type(e).__name__}: {e}")
            continue
        if i == 0:
            first = obj
    for target in item.optional:
        try:
            resolve(target)
        except ImportError:
            pass  # that runner is not importable here
        except AttributeError as e:
            problems.append(f"{target}: {e}")
    if first is not None:
        problems += _params(item.targets[0], first, item.params)
        problems += _assigns(item.targets[0], first, item.assigns)
    for target, params in item.signatures:
        obj = _resolved(target)
        if obj is not None:  # an unresolved target is reported above
            problems += _params(target, obj, params)
    for target, fields in item.assigns_in:
        obj = _resolved(target)
        if obj is not None:
            problems += _assigns(target, obj, fields)
    return problems


def _resolved(target: str):
    try:
        return resolve(target)
    except Exception:
        return None


def _params(target: str, obj, params) -> list[str]:
    """``params`` missing from ``obj``'s signature."""
    if not params:
        return []
    try:
        have = set(inspect.signature(_function(obj)).parameters)
    except (TypeError, ValueError) as e:
        return [f"{target}: no signature ({e})"]
    missing = [p for p in params if p not in have]
    return [f"{target}: parameters {missing} are gone (has {sorted(have)})"] if missing \
        else []


def _assigns(target: str, obj, fields) -> list[str]:
    """Fields ``obj``'s source no longer assigns as ``self.<name> =`` (or
    ``layer.<name> =``: a function that sets a layer's fields)."""
    if not fields:
        return []
    source = inspect.getsource(_function(obj))
    missing = [a for a in fields
               if not re.search(rf"(?:self|layer)\.{a}\b[^=\n]*(?<![=!<>])=(?!=)", source)]
    return [f"{target}: no longer assigns {missing}"] if missing else []


def check_entries(registry=None, release=None, build=None) -> list[tuple]:
    """``(entry, problems)`` for each registry entry that applies to the
    installed vLLM (``vllm_api.applies``: an item listed once per spelling
    is checked in the spelling of this release and build)."""
    from ..integration.vllm_api import applies

    if registry is None:
        from ..integration.vllm_api import REGISTRY as registry
    return [(item, check_item(item)) for item in registry if applies(item, release, build)]


def by_number(entries) -> dict[int, list[str]]:
    """``{item number: problems}`` of :func:`check_entries`' result."""
    report: dict[int, list[str]] = {}
    for item, problems in entries:
        report.setdefault(item.no, []).extend(problems)
    return report


def check_all(registry=None, release=None, build=None) -> dict[int, list[str]]:
    """``{item number: problems}`` for the entries that apply."""
    return by_number(check_entries(registry, release, build))


def not_applicable(registry=None, release=None, build=None) -> list:
    """The registry entries that do not apply to the installed vLLM."""
    from ..integration.vllm_api import applies

    if registry is None:
        from ..integration.vllm_api import REGISTRY as registry
    return [item for item in registry if not applies(item, release, build)]


def checks_of(item) -> list[str]:
    """What is checked of each name of an item, one line each."""
    lines = []
    for i, target in enumerate(item.targets):
        what = ["resolves"]
        if i == 0 and item.params:
            what.append(f"parameters {', '.join(item.params)}")
        if i == 0 and item.assigns:
            what.append(f"assigns {', '.join(item.assigns)}")
        lines.append(f"{target}: {'; '.join(what)}")
    lines += [f"{t}: resolves where importable" for t in item.optional]
    lines += [f"{t}: parameters {', '.join(p)}" for t, p in item.signatures if p]
    lines += [f"{t}: assigns {', '.join(f)}" for t, f in item.assigns_in]
    return lines


def main(as_json: bool = False) -> int:
    import vllm

    from ..integration.vllm_api import REGISTRY, installed

    entries = check_entries()
    report = by_number(entries)
    problems_of = {id(item): problems for item, problems in entries}
    build = installed()[1]
    skipped = {item.no: item.why for item in not_applicable() if item.no not in report}
    if as_json:
        print(json.dumps({"vllm": vllm.__version__, "build": build, "items": report,
                          "not_applicable": skipped,
                          "checks": {item.no: checks_of(item) for item, _ in entries}}))
    else:
        print(f"vLLM {vllm.__version__} ({build} build): {len(report)} registry items apply "
              "(integration/vllm_api.py): every private vLLM name the plugin touches")
        for item in REGISTRY:  # in the registry's order, the entries that do not apply too
            if id(item) not in problems_of:
                if item.no in skipped:
                    print(f"  item {item.no:>2}: not in this vLLM ({item.why})")
                continue
            problems = problems_of[id(item)]
            print(f"  item {item.no:>2}: {'ok' if not problems else 'MOVED'}")
            for line in checks_of(item):
                print(f"           {line}")
            for p in problems:
                print(f"           MOVED: {p}")
    return 1 if any(report.values()) else 0
