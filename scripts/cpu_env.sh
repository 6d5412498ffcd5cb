# Environment for vLLM on CPU machines (sourced by the demo, tests and CI).
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}   # GiB of KV cache per rank
export VLLM_HOST_IP=${VLLM_HOST_IP:-127.0.0.1}               # else vLLM advertises a non-loopback address
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-"0|1"}  # TP=2 on a 2-core, 1-NUMA-node machine
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
