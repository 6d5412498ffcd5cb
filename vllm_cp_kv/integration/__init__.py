"""Thin vLLM 0.32 integration over :mod:`vllm_cp_kv.core`.

Everything here imports vLLM; nothing in ``vllm_cp_kv.core`` does.
"""
