#!/usr/bin/env bash
# Decode server, TP from $TP (default 1). Not sharded: every rank pulls each
# prefill rank's owned blocks into its own (replicated) latent cache. With
# SHARDED=1 (and TP >= 2) the decode's KV is sharded too: each rank pulls only
# the blocks it owns (block j on rank j mod TP), TP times the capacity.
# Usage: start_decode.sh MODEL [PORT=8200] [TRANSPORT=nixl|mooncake]
# Env: HOST (127.0.0.1: the HTTP server binds here; the connector advertises
#      VLLM_HOST_IP), ALLOWED_PREFILL_HOSTS (a JSON list of "host" or "host:side_port", e.g.
#      '["127.0.0.1:5700"]': the only prefill side channels a request's
#      kv_transfer_params may name; unset: any, which lets every client point
#      this server at a host of its choice, and then a decode on a
#      non-loopback host refuses to start unless EXTRA_CONFIG has
#      '"allow_any_prefill": true'), VLLM_CP_KV_SIDE_CHANNEL_SECRET
#      (optional shared secret, the same as the prefill's), EXTRA_CONFIG (more
#      kv_connector_extra_config members, e.g. '"max_shard_size": 8'), BLOCK_SIZE (32),
#      EAGER (set, to anything, 0 included: --enforce-eager; unset: vLLM's default mode, CUDA graphs on a
#      GPU; on a CPU set it, or vLLM compiles the model first),
#      SHARDED (set, to anything, 0 included: --additional-config '{"cp_kv": {"enable": true}}'),
#      EXTRA_ARGS (more vllm serve flags)
MODEL=${1:?model}; PORT=${2:-8200}; TRANSPORT=${3:-nixl}
SHARD_ARGS=(); if [ -n "${SHARDED:-}" ]; then SHARD_ARGS=(--additional-config '{"cp_kv": {"enable": true}}'); fi
EXTRA="{\"transport\": \"$TRANSPORT\"${ALLOWED_PREFILL_HOSTS:+, \"allowed_prefill_hosts\": $ALLOWED_PREFILL_HOSTS}${EXTRA_CONFIG:+, $EXTRA_CONFIG}}"
exec vllm serve "$MODEL" --port "$PORT" --host "${HOST:-127.0.0.1}" --tensor-parallel-size "${TP:-1}" \
  --max-model-len 1024 --max-num-seqs 8 --block-size "${BLOCK_SIZE:-32}" ${EAGER:+--enforce-eager} ${EXTRA_ARGS:-} "${SHARD_ARGS[@]}" \
  --kv-transfer-config "{\"kv_connector\": \"ShardedKVConnector\", \"kv_connector_module_path\": \"vllm_cp_kv.integration.connector\", \"kv_role\": \"kv_consumer\", \"kv_connector_extra_config\": $EXTRA}"
