"""The one-GPU harness: several real vLLM 0.32 ranks on ONE GPU, and the
verification shims the GPU and CPU checks share. Not part of the package.

NCCL refuses two ranks on one device only when they share the host hash
AND the bus id; the host hash comes from ``NCCL_HOSTID`` when it is set. So
with a distinct ``NCCL_HOSTID`` per rank (NET/Socket over loopback) vLLM's
own ``CudaCommunicator``/PyNccl runs unchanged and its collectives can be
captured in CUDA graphs: ``ONEGPU_COMM=nccl`` (the default of
``benchmarks/gpu_onegpu.py``), vLLM's default mode with graphs on, exact
but slow (about 5 ms a collective with 2 ranks, 27 ms with 4). Without it the
groups run on gloo (``ONEGPU_COMM=gloo``) or shared host memory
(``ONEGPU_COMM=shm``), eager only (neither can be captured). Every patch is
applied right after vLLM imports the module that defines its target (an
import hook), in every process, and only when its switch is set:

=====  ===========================================  ======================  ==========================
no.    target (vLLM 0.32)                           change                  switch
=====  ===========================================  ======================  ==========================
1      ``CudaPlatformBase.dist_backend``            "nccl" -> "gloo"        ``ONEGPU=1``, not nccl
2      ``CudaPlatformBase.get_device_communicator`` :class:`OneGPUComm`     ``ONEGPU=1``, not nccl
       ``_cls``
3      ``CudaPlatformBase.use_custom_allreduce``    False                   ``ONEGPU=1``
4      ``EngineArgs._resolve_device_ids``           ``[0] * world``         ``ONEGPU=1``
5      ``EngineArgs.create_engine_config``          executor "mp", no       ``ONEGPU=1``
                                                    custom all-reduce
6      ``gpu_worker.Worker.init_device``            the same device map if  ``ONEGPU=1``
                                                    the config lacks it;
                                                    nccl: ``NCCL_HOSTID``
                                                    per rank
7      ``CpuPlatform.get_device_communicator_cls``  :class:`OneGPUComm`     ``ONEGPU_CPU_COMM=1``
8      ``MLACommonMetadataBuilder`` (class attrs)   decode threshold K,     ``CPKV_SHIM_DECODE_``
       and ``vllm_cp_kv...decode.decode_threshold`` VARLEN; the plugin     ``THRESHOLD=K``
                                                    keeps each backend's
9      ``vllm_cp_kv...connector.scheduler``         P/D test hooks          ``CPKV_TEST_HOOKS=1``
       ``.check_params``; ``...consumer``           (:mod:`pd_hooks`)
       (``Consumer.receive``, ``check_complete``,
       ``read_owned_blocks``)
10     ``vllm_cp_kv...checks.check_kv_cache_dtype``, no refusal (a probe)    ``CPKV_TEST_ALLOW_FP8=1``
       ``check_fp8_backend``
=====  ===========================================  ======================  ==========================

Why:

1-3. gloo and shm: every group (world, TP, PCP, DCP) on gloo, through
     torch.distributed, instead of PyNccl, custom all-reduce and symmetric
     memory, which need one device per rank; with ``ONEGPU_COMM=shm`` the
     all-reduces, all-gathers and reduce-scatters through shared host memory
     (:mod:`shm_comm`: timings then stop being mostly gloo's). nccl: only
     custom all-reduce off (it needs one device per rank).
4-6. vLLM maps local ranks to physical GPUs and forbids duplicates; here
     every rank maps to GPU 0, so the worker and ``GroupCoordinator`` both
     pick ``cuda:0``. nccl: before vLLM's first NCCL call each worker sets
     ``NCCL_HOSTID=onegpu-rank<rank>`` (read once per process) and NCCL's
     socket transport over loopback; vLLM's DCP symmetric-memory and direct
     all-to-all paths are off (they cannot rendezvous on one device). The explicit "mp" executor skips ParallelConfig's
     "world size larger than the number of GPUs" check. The driver sets
     ``kv_cache_memory_bytes`` per rank (no memory profiling: ranks that
     share the GPU would count each other's allocations).
7.   The same communicator under vLLM's CPU platform (gloo there too), so a
     CPU test can compare its answers with vLLM's own CPU communicator.
8.   A verification shim, not a harness patch: MLA builders without a
     threshold of their own (CPU_MLA, TRITON_MLA) treat rows of up to K new
     tokens as decode rows (as FLASH_ATTN_MLA does with 512 and FLASHMLA
     with 128), and the sharded backend keeps every backend's routing
     instead of lowering it to the speculative length
     (``decode.decode_threshold``). Short prefills
     and short extensions of a cached context then reach the shard-aware
     decode as rows with several query tokens, on CPU too. Install it in
     the sharded run only: vLLM's CPU_MLA decode kernel takes one query per
     row.
9.   Test-only, on a P/D decode (CPU and GPU): kv_transfer_params keys that
     pause a pull between the prefill ranks' reads and drop the logical
     positions (the negative control); ``CPKV_TEST_IGNORE_POSITIONS=1``
     drops them for every pull. Why and how: :mod:`pd_hooks`.
10.  Test-only: lets a dense MLA model start with an FP8 KV cache and
     sharded KV where the plugin refuses it (row ``fp8-pcp``: vLLM before
     0.34, PCP on a backend other than TRITON_MLA): the GPU matrix's FP8
     probe runs (issue 39).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys

APPLIED: list[str] = []


def _log(msg: str) -> None:
    sys.stderr.write(f"ONEGPU pid={os.getpid()} {msg}\n")
    sys.stderr.flush()


def _world(args) -> int:
    n = 1
    for name in ("tensor_parallel_size", "pipeline_parallel_size",
                 "prefill_context_parallel_size"):
        n *= max(1, int(getattr(args, name, 1) or 1))
    return n


def communicator_cls():
    """:class:`OneGPUComm`, built on first use (it subclasses a vLLM class)."""
    import torch
    import torch.distributed as dist
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase,
    )

    class OneGPUComm(DeviceCommunicatorBase):
        """vLLM's base communicator (torch.distributed on the group's
        device group, gloo here) with what CudaCommunicator does otherwise:
        an out-of-place all-reduce (PyNccl returns a new tensor), a
        contiguous all-gather input, ``gather`` through an all-gather,
        ``all_gatherv``/``reduce_scatterv`` by padding and a full all-reduce,
        and CudaCommunicator's attribute names, all None (no custom
        all-reduce, PyNccl or symmetric memory). No ``dist_module``: the
        plugin gathers through its torch.distributed branch. With
        ``ONEGPU_COMM=shm`` the all-reduce, all-gather and reduce-scatter go
        through shared host memory instead of gloo (:mod:`shm_comm`; gloo
        still for tensors over a slot and everything else)."""

        def __init__(self, cpu_group, device=None, device_group=None, unique_name="",
                     global_ranks=None, global_world_size=None, use_all2all=False,
                     **_ignored):
            super().__init__(cpu_group, device, device_group, unique_name,
                             global_ranks, global_world_size, use_all2all)
            self.ca_comm = self.pynccl_comm = self.fi_pcie_ipc_ar_comm = None
            self.qr_comm = self.symm_mem_comm = self.aiter_ar_comm = None
            self.shm = None
            if os.environ.get("ONEGPU_COMM", "gloo") == "shm" and self.world_size > 1:
                from shm_comm import ShmExchange

                self.shm = ShmExchange(cpu_group, unique_name)
            _log(f"comm {unique_name} rank {self.rank_in_group}/{self.world_size} "
                 f"device={self.device} backend="
                 f"{dist.get_backend(device_group) if device_group is not None else None}"
                 f"{' collectives=shm' if self.shm else ''}")

        def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
            out = self.shm.all_reduce(input_) if self.shm else None
            if out is None:
                out = input_.clone(memory_format=torch.contiguous_format)
                dist.all_reduce(out, group=self.device_group)
            return out

        def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
            if self.shm:
                out = self.shm.all_gather(input_, dim)
                if out is not None:
                    return out
            return super().all_gather(input_.contiguous(), dim)

        def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
            if self.shm:
                out = self.shm.reduce_scatter(input_, dim)
                if out is not None:
                    return out
            return super().reduce_scatter(input_, dim)

        def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1):
            full = self.all_gather(input_, dim)
            return full if self.rank_in_group == dst else None

        def all_gatherv(self, input_, dim: int = 0, sizes=None):
            if dim != 0:
                raise NotImplementedError("OneGPUComm.all_gatherv: dim 0 only")

            def one(x: torch.Tensor) -> torch.Tensor:
                if sizes is None:
                    return self.all_gather(x, 0)
                m = max(sizes)
                pad = x.new_zeros((m,) + tuple(x.shape[1:]))
                pad[: x.shape[0]] = x
                g = self.all_gather(pad, 0).reshape((self.world_size, m) + tuple(x.shape[1:]))
                return torch.cat([g[r, : sizes[r]] for r in range(self.world_size)], 0)

            return [one(x) for x in input_] if isinstance(input_, (list, tuple)) else one(input_)

        def reduce_scatterv(self, input_: torch.Tensor, dim: int = -1, sizes=None):
            if sizes is None:
                return self.reduce_scatter(input_, dim)
            dim = dim + input_.dim() if dim < 0 else dim
            full = self.all_reduce(input_)
            start = sum(sizes[: self.rank_in_group])
            return full.narrow(dim, start, sizes[self.rank_in_group]).contiguous()

    return OneGPUComm


COMM = f"{__name__}.OneGPUComm"


def __getattr__(name):  # vLLM resolves COMM by qualified name
    if name == "OneGPUComm":
        cls = communicator_cls()
        globals()["OneGPUComm"] = cls
        return cls
    raise AttributeError(name)


def nccl_mode() -> bool:
    return os.environ.get("ONEGPU_COMM", "gloo") == "nccl"


# -- 1-3 ----------------------------------------------------------------------
def patch_platform_cuda(m) -> None:
    base = m.CudaPlatformBase
    base.use_custom_allreduce = classmethod(lambda cls: False)
    if nccl_mode():  # vLLM's own NCCL groups and CudaCommunicator (capturable)
        return
    base.dist_backend = "gloo"
    base.get_device_communicator_cls = classmethod(lambda cls: COMM)


NCCL_ENV = (("NCCL_SOCKET_IFNAME", "lo"), ("NCCL_IB_DISABLE", "1"), ("NCCL_NET", "Socket"),
            ("NCCL_NVLS_ENABLE", "0"), ("VLLM_USE_DIRECT_DCP_A2A", "0"),
            ("VLLM_USE_DIRECT_DCP_Q_GATHER", "0"), ("VLLM_USE_DIRECT_DCP_KV_GATHER", "0"))


# -- 4-5 ----------------------------------------------------------------------
def patch_arg_utils(m) -> None:
    E = m.EngineArgs
    E._resolve_device_ids = lambda self: [0] * _world(self)
    orig = E.create_engine_config

    @functools.wraps(orig)
    def create_engine_config(self, *args, **kwargs):
        if getattr(self, "data_parallel_size", 1) not in (1, None):
            raise RuntimeError("onegpu harness: data_parallel_size must be 1")
        if _world(self) > 1:
            if self.distributed_executor_backend in (None, "mp"):
                self.distributed_executor_backend = "mp"
            self.disable_custom_all_reduce = True
        return orig(self, *args, **kwargs)

    E.create_engine_config = create_engine_config


# -- 6 ------------------------------------------------------------------------
def patch_gpu_worker(m) -> None:
    orig = m.Worker.init_device

    @functools.wraps(orig)
    def init_device(self):
        if nccl_mode():
            # NCCL refuses two ranks with the same host hash AND bus id; a
            # distinct NCCL_HOSTID per rank makes them separate "nodes"
            os.environ["NCCL_HOSTID"] = f"onegpu-rank{self.rank}"
            for k, v in NCCL_ENV:
                os.environ.setdefault(k, v)
        pc = self.parallel_config
        if pc.assigned_physical_gpu_ids is None:
            pc.assigned_physical_gpu_ids = [0] * pc.world_size
        orig(self)
        import torch

        _log(f"worker rank={self.rank} device={self.device} "
             f"current={torch.cuda.current_device()}")

    m.Worker.init_device = init_device


# -- 7 ------------------------------------------------------------------------
def patch_platform_cpu(m) -> None:
    m.CpuPlatform.get_device_communicator_cls = classmethod(lambda cls: COMM)


# -- 8 ------------------------------------------------------------------------
def shim_threshold() -> int:
    return int(os.environ.get("CPKV_SHIM_DECODE_THRESHOLD", "0"))


def patch_mla_threshold(m) -> None:
    # builders that keep vLLM's default of 1 (CPU_MLA, TRITON_MLA); the
    # ones with their own threshold (FLASH_ATTN_MLA 512, FLASHMLA 128) keep it
    m.MLACommonMetadataBuilder.reorder_batch_threshold = shim_threshold()
    m.MLACommonMetadataBuilder.query_len_support = m.QueryLenSupport.VARLEN


def patch_backend_threshold(m) -> None:
    if hasattr(m, "decode_threshold"):  # the plugin keeps the backend's routing
        m.decode_threshold = lambda vllm_config, inner: inner


# -- 9 ------------------------------------------------------------------------
def patch_pd_scheduler(m) -> None:
    import pd_hooks  # imports the connector's params: only once vLLM loads it

    pd_hooks.patch_scheduler(m)


def patch_pd_consumer(m) -> None:
    import pd_hooks

    pd_hooks.patch_consumer(m)


def patch_allow_fp8(m) -> None:
    m.check_kv_cache_dtype = lambda kv_cache_dtype, sparse, release=None: None
    m.check_fp8_backend = lambda name, kv_cache_dtype, sparse, pcp, tp=1: None


def _table() -> dict:
    t = {}
    if os.environ.get("ONEGPU") == "1":
        t.update({"vllm.platforms.cuda": patch_platform_cuda,
                  "vllm.engine.arg_utils": patch_arg_utils,
                  "vllm.v1.worker.gpu_worker": patch_gpu_worker})
    if os.environ.get("ONEGPU_CPU_COMM") == "1":
        t["vllm.platforms.cpu"] = patch_platform_cpu
    if shim_threshold() > 1:
        t["vllm.model_executor.layers.attention.mla_attention"] = patch_mla_threshold
        t["vllm_cp_kv.integration.decode"] = patch_backend_threshold
    if os.environ.get("CPKV_TEST_HOOKS") == "1":
        t["vllm_cp_kv.integration.connector.scheduler"] = patch_pd_scheduler
        t["vllm_cp_kv.integration.connector.consumer"] = patch_pd_consumer
    if os.environ.get("CPKV_TEST_ALLOW_FP8") == "1":
        t["vllm_cp_kv.integration.checks"] = patch_allow_fp8
    return t


PATCHES = _table()


def _apply(name: str, module) -> None:
    if getattr(module, "_onegpu_patched", False):
        return
    PATCHES[name](module)
    module._onegpu_patched = True
    APPLIED.append(name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs the patch of a target module right after the module executes."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        inner = spec.loader.exec_module

        def exec_module(module, _inner=inner, _name=fullname):
            _inner(module)
            _apply(_name, module)

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    if not PATCHES or any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _PostImportFinder())
    for name in PATCHES:  # already imported (a forked child): patch now
        if name in sys.modules:
            _apply(name, sys.modules[name])
    _log("patches armed: " + ", ".join(sorted(PATCHES)))
