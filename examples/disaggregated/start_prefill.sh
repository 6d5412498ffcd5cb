#!/usr/bin/env bash
# Sharded prefill server: TP=2 with cp_kv; each rank serves its owned blocks.
# Usage: start_prefill.sh MODEL [PORT=8100] [TRANSPORT=nixl|mooncake] [SIDE_PORT=5700]
# Env: HOST (127.0.0.1: the HTTP server binds here), BLOCK_SIZE (32),
#      TP (2; with TP=1 the prefill is unsharded, cp_kv off: one rank has
#      nothing to shard, and the connector serves its whole cache),
#      EXPIRY_S (120: free unclaimed blocks after this),
#      SIDE_HOST ($HOST: the side channel and the Mooncake engine bind here only
#      and the decode is told to connect here; set this host's address on the
#      network the decode reaches it by, never 0.0.0.0 unless that is what you
#      mean; docs/deployment.md),
#      VLLM_CP_KV_SIDE_CHANNEL_SECRET (optional shared secret, set the same on
#      the decode: side-channel messages are then authenticated with HMAC),
#      EAGER (set, to anything, 0 included: --enforce-eager; unset: vLLM's default mode, CUDA graphs on a
#      GPU; on a CPU set it, or vLLM compiles the model first),
#      EXTRA_ARGS (more vllm serve flags)
MODEL=${1:?model}; PORT=${2:-8100}; TRANSPORT=${3:-nixl}; SIDE=${4:-5700}
SHARD_ARGS=(); if [ "${TP:-2}" -gt 1 ]; then SHARD_ARGS=(--additional-config '{"cp_kv": {"enable": true}}'); fi
exec vllm serve "$MODEL" --port "$PORT" --host "${HOST:-127.0.0.1}" --tensor-parallel-size "${TP:-2}" \
  --max-model-len 1024 --max-num-seqs 8 --block-size "${BLOCK_SIZE:-32}" ${EAGER:+--enforce-eager} ${EXTRA_ARGS:-} \
  "${SHARD_ARGS[@]}" \
  --kv-transfer-config "{\"kv_connector\": \"ShardedKVConnector\", \"kv_connector_module_path\": \"vllm_cp_kv.integration.connector\", \"kv_role\": \"kv_producer\", \"kv_connector_extra_config\": {\"transport\": \"$TRANSPORT\", \"side_channel_host\": \"${SIDE_HOST:-${HOST:-127.0.0.1}}\", \"side_channel_port\": $SIDE, \"blocks_expiry_s\": ${EXPIRY_S:-120}}}"
