# Environment for vLLM on CPU machines (sourced by the demo, tests and CI).
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}   # GiB of KV cache per rank
export VLLM_HOST_IP=${VLLM_HOST_IP:-127.0.0.1}               # else vLLM advertises a non-loopback address
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-"0|1"}  # TP=2 on a 2-core, 1-NUMA-node machine
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
# vLLM's eager CPU engines still torch.compile a few sampler helpers (the
# logprob rank count among them) with inductor, whose C++ builds cost about
# 12 s per engine on 2 cores and give a tiny model nothing; off, the tokens
# and logprobs are the same (docs/design.md, "CPU runs"). Set it to 0 to compile.
export TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}
# vLLM's n-gram drafter runs numba's parallel loop; numba's OpenMP layer
# spins against the worker's bound thread (an n-gram run 49 s, 19 s with
# the workqueue layer, the same tokens and counters; docs/design.md).
export NUMBA_THREADING_LAYER=${NUMBA_THREADING_LAYER:-workqueue}
