"""One test per row of docs/startup-checks.md: the real vLLM config path
(``EngineArgs.create_engine_config``, no workers) raises with the
documented message; rows that need a GPU platform run the same path with
the plugin's platform query answering "GPU", and the two rows checked when
a worker picks its backend call that check with vLLM's real backend
classes. Also: what the plugin derives, what it keeps of the user's
settings, and that nothing changes without the opt-in."""

import json
import os
import re
import shutil

import pytest

from conftest import ROOT, needs_vllm

pytestmark = needs_vllm
ON = {"cp_kv": {"enable": True}}


def documented_messages():
    rows = {}
    with open(os.path.join(ROOT, "docs", "startup-checks.md")) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == 4 and re.fullmatch(r"[a-z][a-z0-9-]*", cells[0]) and cells[0] != "row":
                rows[cells[0]] = re.findall(r"`([^`]+)`", cells[2])
    return rows


DOC = documented_messages()


def config(model, **kw):
    from vllm.engine.arg_utils import EngineArgs

    args = dict(model=model, tensor_parallel_size=2, max_model_len=512,
                additional_config=ON)
    args.update(kw)
    return EngineArgs(**args).create_engine_config()


def expect_row(row, model, **kw):
    with pytest.raises(ValueError) as info:
        config(model, **kw)
    msg = str(info.value)
    assert any(m in msg for m in DOC[row]), (row, msg)
    assert "cp_kv" in msg


@pytest.fixture(scope="module")
def sparse_model(tiny_dsv2, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("sparse") / "tiny-sparse")
    shutil.copytree(tiny_dsv2, d)
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["index_topk"] = 64
    with open(path, "w") as f:
        json.dump(cfg, f)
    return d


def test_every_documented_row_has_a_test():
    tested = {name[len("test_row_"):].replace("_", "-")
              for name in globals() if name.startswith("test_row_")}
    assert tested == set(DOC), (sorted(tested), sorted(DOC))


def test_row_vllm_version(tiny_dsv2, monkeypatch):
    import vllm

    from vllm_cp_kv.integration.checks import check_vllm_version

    for version in ("0.33.1+cu130", "0.35.0", "1.0.0"):
        monkeypatch.setattr(vllm, "__version__", version)
        expect_row("vllm-version", tiny_dsv2)
    for version in ("0.32.0", "0.32.0+cpu", "0.32.3rc1", "0.34.0", "0.34.1+cu130", "dev"):
        check_vllm_version(version)  # supported, or no version to judge
    # the override lets a release the registry spells start (the GPU matrix
    # tries it first); never one it does not know
    monkeypatch.setenv("VLLM_CP_KV_UNTESTED_VLLM", "1")
    check_vllm_version("0.34.0")
    check_vllm_version("0.33.1")
    for version in ("0.35.0", "1.0.0"):
        monkeypatch.setattr(vllm, "__version__", version)
        expect_row("vllm-version", tiny_dsv2)


def test_row_non_mla(tiny_llama):
    expect_row("non-mla", tiny_llama, tensor_parallel_size=4)


def test_row_sparse_architecture(sparse_model):
    # a DeepSeek-V2 architecture with an index_topk: not vLLM's DSA attention
    expect_row("sparse-architecture", sparse_model)


@pytest.fixture(scope="module")
def dsv32_model(tiny_dsv2, tmp_path_factory):
    """The tiny model's files under a DeepSeek-V3.2 config (not loaded:
    config checks only)."""
    d = str(tmp_path_factory.mktemp("dsv32") / "tiny-dsv32")
    shutil.copytree(tiny_dsv2, d)
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(model_type="deepseek_v32", architectures=["DeepseekV32ForCausalLM"],
               index_topk=64, index_n_heads=4, index_head_dim=128, q_lora_rank=128)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return d


def test_row_sparse_platform(dsv32_model):
    # this machine is CPU-only: vLLM has no sparse MLA backend here
    expect_row("sparse-platform", dsv32_model)


def test_row_sparse_backend():
    from vllm_cp_kv.integration import checks

    for name in checks.SPARSE_BACKENDS:
        checks.check_sparse_backend(name)  # accepted
    with pytest.raises(ValueError) as info:
        checks.check_sparse_backend("FLASHINFER_MLA_SPARSE")
    assert any(m in str(info.value) for m in DOC["sparse-backend"])


def test_row_owned_context():
    """``context_path: "owned"`` only where the owned path runs; "auto" and
    "gathered" are never refused (they read gathered there)."""
    from vllm_cp_kv.integration import checks

    checks.check_owned_context("owned", True, "FLASHMLA", "auto")  # accepted
    for path in ("auto", "gathered"):
        checks.check_owned_context(path, False, "TRITON_MLA", "fp8")
    with pytest.raises(ValueError) as info:
        checks.check_owned_context("owned", False, "TRITON_MLA", "auto")
    assert any(m in str(info.value) for m in DOC["owned-context"])


def test_row_hisparse(tiny_dsv2):
    expect_row("hisparse", tiny_dsv2, attention_config={"hisparse_config": {}})


def test_row_group_size_1(tiny_dsv2):
    expect_row("group-size-1", tiny_dsv2, tensor_parallel_size=1)


def test_row_pcp_platform(tiny_dsv2):
    # this machine is CPU-only: PCP sharding needs the GPU V2 runner
    expect_row("pcp-platform", tiny_dsv2, tensor_parallel_size=1,
               prefill_context_parallel_size=2)


def test_row_pcp_and_tp(tiny_dsv2):
    """Refused on this CPU build's vLLM 0.32 (its PCP x TP group is numbered
    otherwise than its collectives order it), admitted on 0.34."""
    from vllm_cp_kv.integration.checks import CPKVConfigError, check_pcp_and_tp

    expect_row("pcp-and-tp", tiny_dsv2, prefill_context_parallel_size=2)
    check_pcp_and_tp(2, 2, release=(0, 34))
    for release in ((0, 32), (0, 33)):
        with pytest.raises(CPKVConfigError) as info:
            check_pcp_and_tp(2, 4, release=release)
        assert any(m in str(info.value) for m in DOC["pcp-and-tp"])


def test_row_cuda_graphs(tiny_dsv2, dsv32_model, monkeypatch):
    # GPU rows on this CPU machine: the real config path with the plugin's
    # platform query answering "GPU" (the check runs before vLLM's own)
    monkeypatch.setattr(checks_module(), "_on_gpu", lambda: True)
    expect_row("cuda-graphs", tiny_dsv2, enforce_eager=False,
               compilation_config={"cudagraph_mode": "FULL"})
    monkeypatch.setenv("VLLM_CP_KV_DEBUG", "1")  # the debug switch needs eager
    expect_row("cuda-graphs", tiny_dsv2, enforce_eager=False)
    monkeypatch.delenv("VLLM_CP_KV_DEBUG")
    # allowed: the shard-aware decode in every mode that captures decode
    # batches only; the materializing decode and sparse models too (their
    # builders declare no full-graph support: vLLM runs them PIECEWISE)
    from vllm.engine.arg_utils import EngineArgs

    from vllm_cp_kv.integration.checks import check_engine_args
    from vllm_cp_kv.integration.options import CPKVOptions

    for mode in ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE", "PIECEWISE", None):
        args = EngineArgs(model=tiny_dsv2, tensor_parallel_size=2, enforce_eager=False,
                          compilation_config={"cudagraph_mode": mode} if mode else {})
        check_engine_args(args, CPKVOptions(enable=True))
        assert args.decode_context_parallel_size == 2
    args = EngineArgs(model=tiny_dsv2, tensor_parallel_size=2, enforce_eager=False)
    check_engine_args(args, CPKVOptions(enable=True, decode="materialize"))


def test_row_sparse_graphs(dsv32_model, monkeypatch):
    """Graphs with a sparse model: refused on the materializing path (this
    vLLM 0.32; with the release read as 0.34: under PCP, or with decode
    "materialize"), admitted on the shard-aware path (0.34, TP, the default
    decode) and eager."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_cp_kv.integration.checks import check_engine_args, sparse_shard_aware
    from vllm_cp_kv.integration.options import CPKVOptions

    checks = checks_module()
    monkeypatch.setattr(checks, "_on_gpu", lambda: True)
    expect_row("sparse-graphs", dsv32_model, enforce_eager=False)
    config(dsv32_model, enforce_eager=True)  # eager: admitted (as far as the plugin goes)
    on = CPKVOptions(enable=True)
    assert sparse_shard_aware(on, 1, release=(0, 34))
    assert not sparse_shard_aware(on, 1, release=(0, 32))
    assert not sparse_shard_aware(on, 2, release=(0, 34))
    assert sparse_shard_aware(on, 2, release=(0, 34), kv_cache_dtype="fp8_ds_mla")
    assert not sparse_shard_aware(CPKVOptions(enable=True, decode="materialize"), 1,
                                  release=(0, 34))
    monkeypatch.setattr(checks, "_before_034", lambda release: None)  # read as 0.34
    args = EngineArgs(model=dsv32_model, tensor_parallel_size=2, enforce_eager=False)
    check_engine_args(args, on)  # the shard-aware path: graphs admitted
    args = EngineArgs(model=dsv32_model, tensor_parallel_size=1, enforce_eager=False,
                      prefill_context_parallel_size=2, kv_cache_dtype="fp8_ds_mla")
    check_engine_args(args, on)  # PCP with fp8_ds_mla: the shard-aware path too
    for kw, opts in (({"prefill_context_parallel_size": 2, "tensor_parallel_size": 1}, on),
                     ({}, CPKVOptions(enable=True, decode="materialize"))):
        args = EngineArgs(model=dsv32_model, enforce_eager=False,
                          **{"tensor_parallel_size": 2, **kw})
        with pytest.raises(ValueError) as info:
            check_engine_args(args, opts)
        assert any(m in str(info.value) for m in DOC["sparse-graphs"])


def test_sparse_spec_keeps_its_graph_mode(dsv32_model, monkeypatch):
    """MTP with a sparse model on the shard-aware path: every graph mode is
    admitted and left as asked, the drafter's too (the verification rows
    take the decode branch: ``sparse_dcp.SpecRowsAsDecode``; MTP in vLLM's
    default graphs within the floor, docs/sparse.md)."""
    from vllm.config.compilation import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    from vllm_cp_kv.integration.checks import check_engine_args
    from vllm_cp_kv.integration.options import CPKVOptions

    checks = checks_module()
    monkeypatch.setattr(checks, "_on_gpu", lambda: True)
    monkeypatch.setattr(checks, "_before_034", lambda release: None)  # read as 0.34
    spec = {"method": "mtp", "num_speculative_tokens": 2}

    def args(eager=False, mode=None, speculative=spec):
        cc = {"cudagraph_mode": mode} if mode else {}
        return EngineArgs(model=dsv32_model, tensor_parallel_size=2, enforce_eager=eager,
                          speculative_config=speculative, compilation_config=cc)

    for kept, want in ((args(), None), (args(mode="FULL_AND_PIECEWISE"), "FULL_AND_PIECEWISE"),
                       (args(mode="FULL_DECODE_ONLY"), "FULL_DECODE_ONLY"),
                       (args(mode="PIECEWISE"), "PIECEWISE"), (args(eager=True), None),
                       (args(speculative=None), None)):
        check_engine_args(kept, CPKVOptions(enable=True))
        mode = kept.compilation_config.cudagraph_mode
        assert (mode if mode is None else CUDAGraphMode[str(getattr(mode, "name", mode))]
                ) == (want if want is None else CUDAGraphMode[want])


def test_row_spec_pcp_graphs(tiny_dsv2, monkeypatch):
    """Speculation under PCP (TP 1, or PCP x TP on vLLM 0.34, the release
    read as 0.34 here) needs --enforce-eager: vLLM 0.34's own PCP fails with
    MTP in CUDA graphs. Eager under PCP and PCP x TP, and graphs over TP,
    are admitted."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_cp_kv.integration.checks import check_engine_args
    from vllm_cp_kv.integration.options import CPKVOptions

    monkeypatch.setattr(checks_module(), "_on_gpu", lambda: True)
    monkeypatch.setattr(checks_module(), "_before_034", lambda release: None)
    mtp = {"method": "mtp", "num_speculative_tokens": 1}
    for tp in (1, 2):
        args = EngineArgs(model=tiny_dsv2, tensor_parallel_size=tp, enforce_eager=False,
                          prefill_context_parallel_size=2, speculative_config=mtp)
        with pytest.raises(ValueError) as info:
            check_engine_args(args, CPKVOptions(enable=True))
        assert any(m in str(info.value) for m in DOC["spec-pcp-graphs"])
    for eager, tp, pcp in ((True, 1, 2), (True, 2, 2), (False, 2, 1)):
        args = EngineArgs(model=tiny_dsv2, tensor_parallel_size=tp, enforce_eager=eager,
                          prefill_context_parallel_size=pcp, speculative_config=mtp)
        check_engine_args(args, CPKVOptions(enable=True))
        assert args.decode_context_parallel_size == tp * pcp


def test_pcp_and_tp_admitted_on_vllm_034(tiny_dsv2, monkeypatch):
    """On vLLM 0.34 (the release read as 0.34 here) PCP x TP is admitted
    with DCP = PCP x TP, eager and in graphs."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_cp_kv.integration.checks import check_engine_args
    from vllm_cp_kv.integration.options import CPKVOptions

    monkeypatch.setattr(checks_module(), "_on_gpu", lambda: True)
    monkeypatch.setattr(checks_module(), "_before_034", lambda release: None)
    for eager in (True, False):
        args = EngineArgs(model=tiny_dsv2, tensor_parallel_size=2, enforce_eager=eager,
                          prefill_context_parallel_size=2)
        check_engine_args(args, CPKVOptions(enable=True))
        assert args.decode_context_parallel_size == 4


def test_materializing_builders_decline_full_graphs(tiny_dsv2):
    """What lets vLLM keep a materializing decode out of its full graphs:
    the sharded builder's support is NEVER for a decode that reads the full
    view (and the sparse indexer's always), else the inner builder's."""
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend

    from vllm_cp_kv.integration.backend import sharded_backend

    builder = sharded_backend(TritonMLABackend).get_builder_cls()
    inner = TritonMLABackend.get_builder_cls()
    lse = config(tiny_dsv2)
    mat = config(tiny_dsv2, additional_config={"cp_kv": {"enable": True,
                                                         "decode": "materialize"}})
    assert builder.get_cudagraph_support(lse, None) == inner.get_cudagraph_support(lse, None)
    assert builder.get_cudagraph_support(lse, None) != AttentionCGSupport.NEVER
    assert builder.get_cudagraph_support(mat, None) == AttentionCGSupport.NEVER


def test_row_prefetch(tiny_dsv2, dsv32_model, monkeypatch):
    monkeypatch.setattr(checks_module(), "_on_gpu", lambda: True)
    expect_row("prefetch", tiny_dsv2, enforce_eager=True, additional_config={
        "cp_kv": {"enable": True, "prefetch": True, "decode": "materialize"}})
    expect_row("prefetch", dsv32_model, enforce_eager=True, additional_config={
        "cp_kv": {"enable": True, "prefetch": True}})
    from vllm.engine.arg_utils import EngineArgs

    from vllm_cp_kv.integration.checks import check_engine_args
    from vllm_cp_kv.integration.options import CPKVOptions

    args = EngineArgs(model=tiny_dsv2, tensor_parallel_size=1,
                      prefill_context_parallel_size=2, enforce_eager=True)
    with pytest.raises(ValueError) as info:  # PCP (GPU only: checked directly)
        check_engine_args(args, CPKVOptions(enable=True, prefetch=True))
    assert any(m in str(info.value) for m in DOC["prefetch"])
    args = EngineArgs(model=tiny_dsv2, tensor_parallel_size=2, enforce_eager=True)
    check_engine_args(args, CPKVOptions(enable=True, prefetch=True))  # TP, dense: allowed


def test_pcp_sharding_accepts_the_kv_connector(tiny_dsv2, monkeypatch):
    """A PCP-sharded prefill instance may run the cp_kv connector (the
    connector serves each PCP rank's owned blocks; docs/disaggregated.md):
    the engine-args check passes on GPU and derives the shard group."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_cp_kv.integration.options import CPKVOptions

    checks = checks_module()
    monkeypatch.setattr(checks, "_on_gpu", lambda: True)
    args = EngineArgs(model=tiny_dsv2, tensor_parallel_size=1,
                      prefill_context_parallel_size=2, enforce_eager=True,
                      additional_config=ON,
                      kv_transfer_config={"kv_connector": "ShardedKVConnector",
                                          "kv_role": "kv_producer"})
    checks.check_engine_args(args, CPKVOptions.from_additional_config(ON))
    assert args.decode_context_parallel_size == 2


def test_row_decode_backend():
    """GPU MLA backends whose decode kernel returns no LSE (here the real
    backend classes of vLLM that import on a CPU machine; the LSE ones
    pass)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_cp_kv.integration import checks

    for name in ("FLASHMLA", "TRITON_MLA"):  # FLASH_ATTN_MLA needs its GPU library
        backend = AttentionBackendEnum[name].get_class()
        checks.check_decode_backend(backend, on_gpu=True, lse_decode=True)
    no_lse = AttentionBackendEnum["CPU_MLA"].get_class()  # no LSE from its kernel
    checks.check_decode_backend(no_lse, on_gpu=False, lse_decode=True)  # CPU: ours
    checks.check_decode_backend(no_lse, on_gpu=True, lse_decode=False)  # materialize
    with pytest.raises(ValueError) as info:
        checks.check_decode_backend(no_lse, on_gpu=True, lse_decode=True)
    assert any(m in str(info.value) for m in DOC["decode-backend"])


def checks_module():
    from vllm_cp_kv.integration import checks

    return checks


def test_row_pp(tiny_dsv2):
    expect_row("pp", tiny_dsv2, pipeline_parallel_size=2)


def test_row_dcp_mismatch(tiny_dsv2):
    expect_row("dcp-mismatch", tiny_dsv2, tensor_parallel_size=4,
               decode_context_parallel_size=2)


def test_row_interleave_vs_block_size(tiny_dsv2):
    expect_row("interleave-vs-block-size", tiny_dsv2, block_size=32,
               cp_kv_cache_interleave_size=16)


def test_row_interleave_vs_platform_block_size(tiny_dsv2):
    expect_row("interleave-vs-platform-block-size", tiny_dsv2,
               cp_kv_cache_interleave_size=8)


def test_row_spec_method(tiny_dsv2):
    expect_row("spec-method", tiny_dsv2, speculative_config={
        "method": "suffix", "num_speculative_tokens": 2})
    expect_row("spec-method", tiny_dsv2, speculative_config={
        "model": tiny_dsv2, "num_speculative_tokens": 2})  # a draft model


def test_speculative_decoding_runs_with_graphs_on_gpu(monkeypatch):
    """MTP and n-gram are admitted on GPU, eager or with CUDA graphs (the
    verification and draft decode rows read persistent buffers,
    tests/unit/test_graph_buffers.py; measured in the GPU matrix)."""
    from vllm_cp_kv.integration import checks

    for gpu in (True, False):
        monkeypatch.setattr(checks, "_on_gpu", lambda gpu=gpu: gpu)
        for method in ("mtp", "deepseek_mtp", "ngram"):
            checks.check_speculative({"method": method, "num_speculative_tokens": 1})
    checks.check_speculative({"model": "[ngram]", "num_speculative_tokens": 1})
    checks.check_speculative('{"method": "mtp", "num_speculative_tokens": 1}')  # CLI JSON


def test_row_dbo(tiny_dsv2):
    expect_row("dbo", tiny_dsv2, enable_dbo=True)


def test_row_worker_cls(tiny_dsv2):
    expect_row("worker-cls", tiny_dsv2, worker_cls="my.pkg.Worker")


def test_row_bad_option(tiny_dsv2):
    expect_row("bad-option", tiny_dsv2, additional_config={"cp_kv": {"enable": True, "shards": 2}})
    expect_row("bad-option", tiny_dsv2, additional_config={"cp_kv": {"enable": "yes"}})
    expect_row("bad-option", tiny_dsv2, additional_config={"cp_kv": {"enable": True,
                                                                     "decode": "ring"}})
    expect_row("bad-option", tiny_dsv2, additional_config={"cp_kv": True})
    expect_row("bad-option", tiny_dsv2, additional_config={"cp_kv": {"enable": True,
                                                                     "max_scratch_blocks": -1}})
    expect_row("bad-option", tiny_dsv2, additional_config={"cp_kv": {"enable": True,
                                                                     "workspace_tokens": "8k"}})


def platform_block_size(model):
    """The block size vLLM picks here without the plugin (16 with CPU_MLA on
    CPUs without AMX, 32 with AMX_MLA when asked for)."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=model, tensor_parallel_size=2, max_model_len=512,
                      block_size=32).create_engine_config().cache_config.block_size


def test_derived_settings(tiny_dsv2):
    from vllm_cp_kv.integration.plugin import WORKER_CLS

    cfg = config(tiny_dsv2, block_size=32)
    p = cfg.parallel_config
    assert p.decode_context_parallel_size == 2
    block = cfg.cache_config.block_size
    assert block == platform_block_size(tiny_dsv2)
    assert p.cp_kv_cache_interleave_size == block
    assert p.worker_cls == WORKER_CLS
    # on CPU: PyTorch's rope instead of vLLM's CPU rotary kernel
    assert "-rotary_embedding" in cfg.compilation_config.custom_ops
    # prefix caching stays as vLLM's default (on) with sharding, on every CPU
    assert cfg.cache_config.enable_prefix_caching is True


def test_user_settings_are_kept(tiny_dsv2):
    cfg = config(tiny_dsv2, enable_prefix_caching=False,
                 compilation_config={"custom_ops": ["all", "+rotary_embedding"]})
    assert cfg.cache_config.enable_prefix_caching is False
    ops = cfg.compilation_config.custom_ops
    assert "+rotary_embedding" in ops and "-rotary_embedding" not in ops


def test_nothing_changes_without_the_opt_in(tiny_dsv2):
    from vllm_cp_kv.integration.plugin import WORKER_CLS

    for extra in ({}, {"cp_kv": {"enable": False}}):
        cfg = config(tiny_dsv2, additional_config=extra)
        assert cfg.parallel_config.decode_context_parallel_size == 1
        assert cfg.parallel_config.cp_kv_cache_interleave_size == 1
        assert cfg.parallel_config.worker_cls != WORKER_CLS
    # a non-MLA model and TP=1 are fine without the opt-in
    config(tiny_dsv2, tensor_parallel_size=1, additional_config={})


def test_last_token_gather_alone_keeps_vllms_layout(tiny_dsv2):
    """kv_sharding=false: no derived DCP, PCP allowed (last-token gather
    only); the checks run on real engine args."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_cp_kv.integration.checks import check_engine_args
    from vllm_cp_kv.integration.options import CPKVOptions

    args = EngineArgs(model=tiny_dsv2, tensor_parallel_size=1,
                      prefill_context_parallel_size=2)
    check_engine_args(args, CPKVOptions(enable=True, kv_sharding=False))
    assert args.decode_context_parallel_size == 1
    assert "-rotary_embedding" not in args.compilation_config.custom_ops
    with pytest.raises(ValueError, match="GPU V2 model runner"):
        check_engine_args(args, CPKVOptions(enable=True))  # CPU: no PCP sharding


def test_row_amx_q_replicate(tiny_dsv2, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    expect_row("amx-q-replicate", tiny_dsv2, dcp_q_replicate=True)
    # with CPU_MLA asked for, the flag is fine
    config(tiny_dsv2, dcp_q_replicate=True, attention_config={"backend": "CPU_MLA"})


def test_row_fp8_pcp():
    """FP8 on a dense model shards on vLLM 0.34 (run on the H200,
    docs/fp8.md): over TP on any backend vLLM runs it with, over PCP on
    TRITON_MLA only (vLLM's own PCP with FP8 dies on FLASHMLA, so there is no
    reference); checked directly (on CPU the PCP row of the GPU runner comes
    first, and the backend is chosen by the workers)."""
    from vllm_cp_kv.integration.checks import (PCP_FP8_BACKENDS, CPKVConfigError,
                                               check_fp8_backend, check_kv_cache_dtype)

    new = (0, 34)
    for spelling in ("fp8", "fp8_e4m3", "fp8_e5m2"):
        check_kv_cache_dtype(spelling, sparse=False, release=new)  # admitted
        # run on 0.34 only: 0.32 (this CPU build's, read when not given) refused
        for release in ((0, 32), None):
            with pytest.raises(CPKVConfigError) as info:
                check_kv_cache_dtype(spelling, sparse=False, release=release)
            assert any(m in str(info.value) for m in DOC["fp8-pcp"])
        for name in ("FLASHMLA", "TRITON_MLA", "FLASH_ATTN_MLA"):
            check_fp8_backend(name, spelling, sparse=False, pcp=1)  # TP: any backend
            if name in PCP_FP8_BACKENDS:
                check_fp8_backend(name, spelling, sparse=False, pcp=2)
                continue
            with pytest.raises(CPKVConfigError) as info:
                check_fp8_backend(name, spelling, sparse=False, pcp=2)
            assert any(m in str(info.value) for m in DOC["fp8-pcp"])
            assert "TRITON_MLA" in str(info.value)
    assert PCP_FP8_BACKENDS == ("TRITON_MLA",)
    check_kv_cache_dtype("fp8_ds_mla", sparse=True, release=(0, 32))  # V3.2's
    check_kv_cache_dtype("auto", sparse=False, release=(0, 32))
    check_fp8_backend("FLASHMLA_SPARSE", "fp8_ds_mla", sparse=True, pcp=2)
    check_fp8_backend("FLASHMLA", "auto", sparse=False, pcp=2)


def test_row_scratch_cap():
    """Checked where the worker sizes the scratch (engine start): the bound it
    reserves against one request of max_model_len."""
    from vllm_cp_kv.core.capacity import one_request_view_blocks, scratch_blocks_bound
    from vllm_cp_kv.integration.checks import check_scratch_cap

    one = one_request_view_blocks(shard_size=2, block_size=16, max_model_len=1000)
    assert one == 64  # 63 logical blocks, 32 a rank, 2 ranks
    for cap in (1, 63):  # rounds to 0 blocks; one short of a request
        blocks = scratch_blocks_bound(
            available_bytes=1 << 30, page_bytes=1152 * 16, num_layers=2, shard_size=2,
            block_size=16, max_num_seqs=4, max_model_len=1000, cap_blocks=cap)
        with pytest.raises(ValueError) as info:
            check_scratch_cap(blocks, cap, one)
        assert any(m in str(info.value) for m in DOC["scratch-cap"])
    check_scratch_cap(64, 64, one)


def test_query_replication_is_derived_on_cpu_except_with_amx(tiny_dsv2, monkeypatch):
    """CPU, TP shard group: vLLM's --dcp-q-replicate is turned on (the
    shard-aware decode then skips its query all-gather), unless the user set
    it or vLLM will pick AMX_MLA (whose absorption packs the rank's heads)."""
    import torch
    from vllm.engine.arg_utils import EngineArgs

    from vllm_cp_kv.integration import checks
    from vllm_cp_kv.integration.options import CPKVOptions

    def derived(amx: bool, decode: str = "lse", **kw):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        args = EngineArgs(model=tiny_dsv2, tensor_parallel_size=2, **kw)
        checks.check_engine_args(args, CPKVOptions(enable=True, decode=decode))
        return args.dcp_q_replicate

    assert derived(amx=False) is True
    assert derived(amx=True) is None  # AMX_MLA: left as vLLM's default (off)
    assert derived(amx=True, attention_config={"backend": "CPU_MLA"}) is True
    assert derived(amx=False, dcp_q_replicate=False) is False  # the user's choice
    assert derived(amx=False, decode="materialize") is None  # no query gather to skip


# The MLA architectures of vLLM 0.34 (vllm_cp_kv/integration/models.py,
# docs/models.md), on the config path: every architecture of a refused
# family is refused with its row's message naming it, whatever vLLM says of
# MLA and with the unverified-model option on; the unverified ones only
# without that option; the ones that run pass (the negative control). The
# hf configs are transformers' own classes where it has them.
HF_CONFIGS = {"deepseek-v4": "DeepseekV4Config", "glm5-next": "Glm5NextTextConfig",
              "kimi-linear": "KimiLinearConfig", "hy-v4": "HYV4Config",
              "dense-mla": "LongcatFlashConfig", "deepseek-v2": "DeepseekV3Config"}


def model_config(arch, family, use_mla=True):
    from types import SimpleNamespace

    import transformers

    name = HF_CONFIGS.get(family)
    hf = getattr(transformers, name)() if name else SimpleNamespace()
    return SimpleNamespace(model=f"tiny-{arch}", architectures=[arch], use_mla=use_mla,
                           hf_text_config=hf)


def options(allow=False):
    from vllm_cp_kv.integration.options import CPKVOptions

    return CPKVOptions(enable=True, allow_unverified_model=allow)


def expect_family_row(row):
    from vllm_cp_kv.integration import checks, models

    families = [f for f in models.FAMILIES if f.row == row]
    assert families, row
    for fam in families:
        for arch in fam.archs:
            for use_mla, allow in ((True, False), (False, False), (True, True)):
                with pytest.raises(ValueError) as info:
                    checks.check_model(model_config(arch, fam.name, use_mla), options(allow))
                msg = str(info.value)
                assert any(m in msg for m in DOC[row]), (row, msg)
                assert msg.startswith("cp_kv: ") and arch in msg, msg


def test_row_arch_deepseek_v4():
    expect_family_row("arch-deepseek-v4")


def test_row_arch_dots3_note():
    expect_family_row("arch-dots3-note")


def test_row_arch_glm5_next():
    expect_family_row("arch-glm5-next")


def test_row_arch_kimi_linear():
    expect_family_row("arch-kimi-linear")


def test_row_arch_bailing_hybrid():
    expect_family_row("arch-bailing-hybrid")


def test_row_arch_hy_v4():
    expect_family_row("arch-hy-v4")


def test_row_arch_mistral_large_4():
    expect_family_row("arch-mistral-large-4")


def test_row_arch_sarvam_mla():
    expect_family_row("arch-sarvam-mla")


def test_row_arch_eagle():
    expect_family_row("arch-eagle")


def test_refused_by_name_before_vllm_builds_its_model_config(tmp_path):
    """A checkpoint whose model type this transformers does not know (vLLM
    could not build its config and would say so without naming cp_kv) is
    refused by its architecture's row first; an unverified one too, unless
    the option, which leaves it to vLLM's own error (the control)."""
    def checkpoint(arch, model_type):
        d = tmp_path / arch
        d.mkdir()
        (d / "config.json").write_text(json.dumps(
            {"model_type": model_type, "architectures": [arch]}))
        return str(d)

    asr = checkpoint("MingV3ASRForConditionalGeneration", "ming_v3_asr_unknown")
    expect_row("arch-bailing-hybrid", asr)
    pangu = checkpoint("PanguUltraMoEForCausalLM", "pangu_unknown")
    expect_row("arch-unverified", pangu)
    with pytest.raises(ValueError) as info:
        config(pangu, additional_config={"cp_kv": {"enable": True,
                                                   "allow_unverified_model": True}})
    assert "cp_kv" not in str(info.value)  # past cp_kv's checks: vLLM's own error


def test_row_arch_unverified(caplog):
    from vllm_cp_kv.integration import checks, models

    fam = next(f for f in models.FAMILIES if f.row == "arch-unverified")
    for arch in fam.archs + ("SomeNewMLAForCausalLM",):
        with pytest.raises(ValueError) as info:
            checks.check_model(model_config(arch, fam.name), options())
        msg = str(info.value)
        assert any(m in msg for m in DOC["arch-unverified"]) and arch in msg, msg
        checks.check_model(model_config(arch, fam.name), options(allow=True))  # admitted
    # the architectures that ran sharded start without the option
    for fam in models.FAMILIES:
        if fam.status == models.RUNS:
            for arch in fam.archs:
                checks.check_model(model_config(arch, "deepseek-v2"), options())
    # ... unless vLLM resolved another implementation for them (--model-impl
    # transformers: its own MLA, never run sharded)
    via_transformers = model_config("DeepseekV3ForCausalLM", "deepseek-v2")
    via_transformers.architecture = "TransformersMoEForCausalLM"
    with pytest.raises(ValueError) as info:
        checks.check_model(via_transformers, options())
    assert "TransformersMoEForCausalLM" in str(info.value)
    checks.check_model(via_transformers, options(allow=True))


def test_mtp_drafts_of_unverified_targets_are_row_arch_unverified():
    """MTP drafting sharded only where it ran (DeepSeek-V3, V3.2 / GLM-5):
    another target's draft needs the option; n-gram and the DeepSeek
    targets pass (the controls)."""
    from types import SimpleNamespace

    from vllm_cp_kv.integration import checks

    mtp, ngram = SimpleNamespace(method="mtp"), SimpleNamespace(method="ngram")
    glm = model_config("Glm4MoeLiteForCausalLM", "dense-mla")
    with pytest.raises(ValueError) as info:
        checks.check_draft(mtp, glm, options())
    msg = str(info.value)
    assert any(m in msg for m in DOC["arch-unverified"]) and "Glm4MoeLiteForCausalLM" in msg
    checks.check_draft(mtp, glm, options(allow=True))
    checks.check_draft(ngram, glm, options())
    for arch in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"):
        checks.check_draft(mtp, model_config(arch, "deepseek-v2"), options())


@pytest.mark.parametrize("arch", ["KimiLinearForCausalLM", "HYV4ForCausalLM",
                                  "LongcatFlashForCausalLM", "Glm4MoeLiteForCausalLM",
                                  "AXK1ForCausalLM"])
def test_the_architecture_rows_on_vllms_own_config_path(arch, tmp_path_factory):
    """The same verdicts from EngineArgs, where this vLLM builds the
    architecture's model config (a tiny config of transformers' class; no
    weights: the check comes first): refused with the family's row, or,
    for the families that run (the control), a config built sharded."""
    from vllm_cp_kv.integration import models
    from vllm_cp_kv.tools.tiny_model import build_arch_config

    model = build_arch_config(arch, str(tmp_path_factory.mktemp("arch") / arch))
    row = models.ARCHITECTURES[arch].row
    if row:
        expect_row(row, model)
    else:
        assert config(model).parallel_config.decode_context_parallel_size == 2


def mla_spec(**kw):
    import torch
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576,
                            dtype=torch.bfloat16, **kw)


def test_row_cache_kind():
    import torch
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowMLASpec, SparseCacheRole

    from vllm_cp_kv.integration import checks

    # the latent and DeepSeek-V3.2's indexer keys: sharded
    checks.check_kv_cache_specs({"l0": mla_spec(), "l0.indexer": mla_spec(
        cache_role=SparseCacheRole.INDEXER)}, {})
    bad = {"window": SlidingWindowMLASpec(block_size=16, num_kv_heads=1, head_size=576,
                                          dtype=torch.bfloat16, sliding_window=128),
           "compressed": mla_spec(tokens_per_state=4),
           "v4": mla_spec(model_version="deepseek_v4"),
           "windowed-mla": mla_spec(sliding_window=64),
           "kda": MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,))}
    for name, spec in bad.items():
        with pytest.raises(ValueError) as info:
            checks.check_kv_cache_specs({"l0": mla_spec(), name: spec}, {})
        msg = str(info.value)
        assert any(m in msg for m in DOC["cache-kind"]) and name in msg, msg


def test_row_kv_sharing():
    from vllm_cp_kv.integration import checks

    with pytest.raises(ValueError) as info:
        checks.check_kv_cache_specs({"layers.0": mla_spec()}, {"layers.1": "layers.0"})
    msg = str(info.value)
    assert any(m in msg for m in DOC["kv-sharing"]) and "layers.1" in msg, msg
