"""vLLM 0.33+'s profile run asks each MLA impl to reserve its decode
workspace (``reserve_workspace``; TRITON_MLA sizes its split-KV logits for
``num_heads * dcp_world_size`` heads) so that the KV cache is sized around
it. A sharded impl reports DCP off, yet the shard-aware decode runs the
kernel on the shard group's heads: its reservation counts them (registry
item 27). The vLLM impl is a stand-in here (TRITON_MLA is GPU-only); the
override is the plugin's own mixin. Negative control: the impl alone counts
one rank's heads."""

from conftest import needs_vllm

pytestmark = needs_vllm


class StandIn:
    """TRITON_MLA's impl as far as the reservation goes."""

    num_heads = 8

    def reserve_workspace(self):
        self.reserved_heads = self.num_heads * self.dcp_world_size


def test_the_sharded_impl_reserves_for_the_shard_groups_heads():
    from vllm_cp_kv.integration.backend import ShardedImpl

    impl = object.__new__(type("Sharded", (ShardedImpl, StandIn), {}))
    impl.dcp_world_size, impl.cp_kv_decode_ranks = 1, 4
    impl.reserve_workspace()
    assert impl.reserved_heads == 32
    assert impl.dcp_world_size == 1  # reported unsharded again after the block
    plain = StandIn()
    plain.dcp_world_size = 1
    plain.reserve_workspace()
    assert plain.reserved_heads == 8


def _config(tp=4, pcp=1, decode="lse"):
    from types import SimpleNamespace

    return SimpleNamespace(
        additional_config={"cp_kv": {"enable": True, "decode": decode}},
        parallel_config=SimpleNamespace(tensor_parallel_size=tp,
                                        prefill_context_parallel_size=pcp))


def test_the_decode_kernel_runs_on_the_groups_heads_only_with_the_shard_aware_decode():
    """Builder and impl take the count from one rule: the TP group's heads
    with the shard-aware decode; this rank's own with a full view
    (``decode: "materialize"``, sparse models) or under PCP."""
    from vllm_cp_kv.integration.backend import decode_kernel_ranks

    assert decode_kernel_ranks(_config(), sparse=False) == 4
    assert decode_kernel_ranks(_config(decode="materialize"), sparse=False) == 1
    assert decode_kernel_ranks(_config(), sparse=True) == 1
    assert decode_kernel_ranks(_config(tp=1, pcp=2), sparse=False) == 1
