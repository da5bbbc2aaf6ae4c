"""Whether the substitution stayed inside vLLM's test files (see vllm_substitution.py).

The plugin swaps vLLM's names for ours only while vLLM's test files are collected, so
that they bind ours; every other module must keep reaching vLLM's real classes (our own
code takes some of its behaviour from them). Standard library only, so that the check
is tested without vLLM (test_harness.py).
"""

from __future__ import annotations

from typing import Any

__all__ = ["unsound_bindings"]


def unsound_bindings(
    modules: dict[str, Any], swapped: dict[str, Any], allowed: tuple[str, ...] = ()
) -> list[str]:
    """References to a substitute that only vLLM's test files may hold.

    ``swapped`` maps each vLLM name to our object that replaced it. A module of vLLM
    (``vllm.*``) holding one of ours under any name, or any other module (vLLM's tests,
    ``tests.*``, and the plugin, ``vllm_substitution``, aside) holding one of ours
    under the vLLM name it replaces (``CPUOffloadingSpec`` bound to our spec), took it
    from a swapped module while collection ran: that code would then test ours against
    ours. ``allowed``: ``module.attribute`` swapped on purpose. Our own modules may of
    course hold our classes under their own names (``LRUPolicy``).
    """
    ours = {id(obj) for obj in swapped.values()}
    found = []
    for module_name, module in list(modules.items()):
        if module is None:
            continue
        if module_name in ("tests", "vllm_substitution") or module_name.startswith("tests."):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        is_vllm = module_name == "vllm" or module_name.startswith("vllm.")
        for attribute, value in list(namespace.items()):
            if id(value) not in ours:
                continue
            where = f"{module_name}.{attribute}"
            if where not in allowed and (is_vllm or swapped.get(attribute) is value):
                found.append(where)
    return sorted(found)
