#!/usr/bin/env bash
# On the GPU machine, after staging (docs/gpu-testing.md): unpack the payload
# from /root/stage into /root/site, use the machine's own NVIDIA libraries next
# to the carried NCCL, and register this checkout's vLLM plugin entry point.
# Usage: source scripts/gpu/setup_device.sh   (idempotent)
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VS=/opt/torch/.venv/lib/python3.12/site-packages
if [ ! -d /root/site/vllm ]; then
  t=$(date +%s)
  cat /root/stage/p.* | xz -d -T0 | tar -x -C /root
  echo "payload unpacked in $(( $(date +%s) - t )) s"
  for d in "$VS"/nvidia/*/; do n=$(basename "$d"); [ -e /root/site/nvidia/$n ] || ln -s "${d%/}" /root/site/nvidia/$n; done
  rm -rf "$VS"/torchaudio "$VS"/torchaudio-*.dist-info
fi
# The CuteDSL add-on (scripts/gpu/build_cutedsl.sh), where staged into
# /root/cstage: vLLM's own DCP sparse top-k merge and CuteDSL kernels
if [ -e /root/cstage/c.00 ] && [ ! -d /root/site-cutedsl ]; then
  cat /root/cstage/c.* | xz -d -T0 | tar -x -C /root && echo "CuteDSL add-on unpacked"
fi
CUTEDSL=""
[ -d /root/site-cutedsl ] && CUTEDSL=/root/site-cutedsl:/root/site-cutedsl/nvidia_cutlass_dsl/dsl_packages:
# vLLM finds plugins through entry points: a dist-info next to the checkout
mkdir -p /root/cpkv/vllm_cp_kv-0.1.0.dist-info
printf 'Metadata-Version: 2.1\nName: vllm_cp_kv\nVersion: 0.1.0\n' > /root/cpkv/vllm_cp_kv-0.1.0.dist-info/METADATA
printf '[vllm.general_plugins]\ncp_kv = vllm_cp_kv:register\n' > /root/cpkv/vllm_cp_kv-0.1.0.dist-info/entry_points.txt
export PYTHONPATH=/root/site:$CUTEDSL/root/cpkv:$ROOT PYTHONUNBUFFERED=1
# NVLink multicast off (platform notes); no flashinfer in the payload
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_HOST_IP=127.0.0.1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# The payload has no nvidia-cutlass-dsl: let DeepSeek-V3.2's fused-q helper
# fall back to its Triton path instead of failing at import (idempotent).
python3 - <<'PY'
p = "/root/site/vllm/models/deepseek_v32/common/kernels.py"
s = open(p).read()
old = """        from vllm.models.deepseek_v32.nvidia.ops.fused_q_cutedsl import (
            fused_q_cutedsl,
            is_fused_q_cutedsl_supported,
        )
"""
new = """        try:
            from vllm.models.deepseek_v32.nvidia.ops.fused_q_cutedsl import (
                fused_q_cutedsl,
                is_fused_q_cutedsl_supported,
            )
        except ImportError:  # no CuteDSL in the payload: Triton path
            fused_q_cutedsl = None
            is_fused_q_cutedsl_supported = lambda *a, **k: False
"""
if old in s:
    open(p, "w").write(s.replace(old, new))
    print("deepseek_v32 fused-q: CuteDSL import made optional")
# vLLM 0.34's kernel warmup imports MiniMax-M3's MSA warmup on every CUDA
# worker, whose modules import CuTe DSL at the top: without it in the
# payload, skip that warmup (it serves MiniMax-M3 models only)
p = "/root/site/vllm/model_executor/warmup/kernel_warmup.py"
s = open(p).read()
old = """        from vllm.model_executor.warmup.minimax_m3_msa_warmup import (
            minimax_m3_msa_warmup,
        )

        minimax_m3_msa_warmup(worker)
"""
new = """        try:
            from vllm.model_executor.warmup.minimax_m3_msa_warmup import (
                minimax_m3_msa_warmup,
            )
        except ImportError:  # no CuteDSL in the payload: MiniMax-M3 only
            minimax_m3_msa_warmup = lambda worker: None

        minimax_m3_msa_warmup(worker)
"""
if old in s:
    open(p, "w").write(s.replace(old, new))
    print("kernel warmup: MiniMax-M3 MSA warmup made optional")
# The MoE router's fp32-weight GEMM on Hopper (GLM-4.7-Flash's float32
# gate) is a CuTe DSL kernel: without CuteDSL in the payload, take the
# router's torch path instead of failing at model build
p = "/root/site/vllm/model_executor/layers/fused_moe/router/gate_linear.py"
s = open(p).read()
old = """            and input_size % 8 == 0
        )
"""
new = """            and input_size % 8 == 0
            and __import__("importlib.util").util.find_spec("cutlass") is not None
        )
"""
if old in s and new not in s:
    open(p, "w").write(s.replace(old, new, 1))
    print("router gate: the CuteDSL bf16x3 GEMM only where CuteDSL is installed")
PY
