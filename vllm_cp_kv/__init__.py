"""vllm_cp_kv: sharded MLA KV cache for context parallelism, as a vLLM plugin.

``vllm_cp_kv.core`` is vLLM-independent (ownership rule, materialization
plan and run, capacity arithmetic); ``vllm_cp_kv.integration`` wires it into
vLLM 0.32 and is loaded through the ``vllm.general_plugins`` entry point.
"""

__version__ = "0.1.0"


def register() -> None:
    """vLLM general-plugin entry point; inert unless ``cp_kv.enable``."""
    from .integration.plugin import register as _register

    _register()
