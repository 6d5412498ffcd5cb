"""``vllm-cp-kv compat``: resolve every vLLM name the plugin rebinds or
relies on (``integration/plugin.py``'s ``REGISTRY``) against the installed
vLLM, and say what moved.

    vllm-cp-kv compat [--json]

For each registry item: every target must import and resolve (a module
attribute, a class attribute, or a dataclass / pydantic field); the
parameters the wrapper passes by name must be in the first target's
signature; the instance fields the plugin sets must still be assigned by
the first target (``self.<name> =`` in its source). Exit status 1 when
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
    """What moved for one :class:`~vllm_cp_kv.integration.plugin.Rebinding`
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
    if first is None:
        return problems
    fn = _function(first)
    if item.params:
        try:
            have = set(inspect.signature(fn).parameters)
        except (TypeError, ValueError) as e:
            return problems + [f"{item.targets[0]}: no signature ({e})"]
        missing = [p for p in item.params if p not in have]
        if missing:
            problems.append(f"{item.targets[0]}: parameters {missing} are gone "
                            f"(has {sorted(have)})")
    if item.assigns:
        source = inspect.getsource(fn)
        missing = [a for a in item.assigns
                   if not re.search(rf"self\.{a}\b[^=\n]*(?<![=!<>])=(?!=)", source)]
        if missing:
            problems.append(f"{item.targets[0]}: no longer assigns {missing}")
    return problems


def check_all(registry=None) -> dict[int, list[str]]:
    """``{item number: problems}`` for the whole registry."""
    if registry is None:
        from ..integration.plugin import REGISTRY as registry
    return {item.no: check_item(item) for item in registry}


def main(as_json: bool = False) -> int:
    import vllm

    report = check_all()
    if as_json:
        print(json.dumps({"vllm": vllm.__version__, "items": report}))
    else:
        print(f"vLLM {vllm.__version__}: {len(report)} registry items "
              "(integration/plugin.py)")
        for no, problems in report.items():
            print(f"  item {no:>2}: {'ok' if not problems else 'MOVED'}")
            for p in problems:
                print(f"           {p}")
    return 1 if any(report.values()) else 0
