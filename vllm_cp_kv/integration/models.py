"""The MLA architectures of vLLM's registry and what cp_kv does with each
(docs/models.md): it runs them sharded, refuses them at startup with a
reason, or refuses them as not yet run sharded here.

Listed from vLLM 0.34's registry and model code (every architecture whose
attention layers are MLA, draft models included), with the attention kinds
of its layers and the KV cache specs vLLM makes for them. Two checks use it:

* ``checks.check_model`` (startup, on the model config: before any weight
  is loaded) refuses a family with a layer or cache kind cp_kv cannot
  shard, naming the architecture, the kind and what to do (:func:`refusal`);
  an MLA architecture that has not run sharded with this release (or an
  MTP draft of one, ``checks.check_draft``) is refused unless
  ``cp_kv.allow_unverified_model`` is set.
* ``checks.check_kv_cache_specs`` (worker, once the model is built) refuses
  any layer whose cache is not the plain MLA latent (or DeepSeek-V3.2's
  indexer keys, :func:`spec_problem`) or that reads another layer's cache:
  the net under the table, which holds whatever a config says, the option
  included.
"""

from __future__ import annotations

from dataclasses import dataclass

RUNS, UNVERIFIED, REFUSED = "runs", "unverified", "refused"


@dataclass(frozen=True)
class Family:
    """Architectures that share their attention code in vLLM 0.34."""
    name: str
    archs: tuple[str, ...]
    layers: str         # the attention kinds of its layers
    caches: str         # the KV cache specs vLLM makes for them
    status: str         # RUNS, UNVERIFIED or REFUSED
    why: str = ""       # REFUSED: the layer or cache kind cp_kv cannot shard
    needs: str = ""     # what running it sharded would take
    shown_by: str = ""  # the run that shows the status

    @property
    def row(self) -> str:
        """Its row of docs/startup-checks.md ("" where it runs)."""
        return {RUNS: "", UNVERIFIED: "arch-unverified"}.get(self.status, f"arch-{self.name}")


MLA = "MLAAttentionSpec (the latent)"
INDEXER = "MLAAttentionSpec with cache_role INDEXER (the indexer keys)"
DENSE_NEEDS = ("a GPU run of a tiny instance: tokens within the floor of two unsharded "
               "layouts, capacity, the debug checks (benchmarks/gpu_models.py)")
KDA = "KDA / gated-delta linear attention (per-request recurrent state)"
KDA_WHY = ("its linear-attention layers keep a per-request recurrent state (MambaSpec), "
           "which has no blocks to own and which vLLM's DCP does not split")
KDA_NEEDS = ("a layout per KV cache group: the MLA groups sharded, the state groups "
             "replicated on every rank of the shard group (and their prefix-cache "
             "alignment kept), checked against the unsharded run")

FAMILIES = (
    Family("deepseek-v2", ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                           "DeepSeekMTPModel"),
           "dense MLA (DeepSeek-V2/V3, Kimi-K2 configs); MTP draft layers alike", MLA, RUNS,
           shown_by="CPU suite (tests/vllm); GPU matrix benchmarks/results/"
                    "h200x1-2026-12-04-vllm-0.34, h100x1-2026-12-05-recall"),
    Family("deepseek-v32", ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM",
                            "DeepseekV32MTPModel"),
           "sparse MLA (DSA: lightning indexer, top-k) on every layer", f"{MLA}; {INDEXER}",
           RUNS, shown_by="GPU benchmarks/results/h200x1-2026-12-04-sparse-shard-aware "
                          "(GLM-5 row too); MTP and P/D: h100x1-2026-12-06-sparse-mtp-graphs"),
    Family("glm4-moe-lite", ("Glm4MoeLiteForCausalLM",),
           "dense MLA (GLM-4.7-Flash)", MLA, RUNS,
           shown_by="CPU: tests/vllm/test_models_e2e.py (TP=2 float32, tokens equal "
                    "unsharded, debug checks, corrupted-block control); GPU: benchmarks/"
                    "results/h100x1-2026-12-06-models (TP=2 graphs within the floor, "
                    "1.98x, debug run)"),
    Family("axk1", ("AXK1ForCausalLM",), "dense MLA (A.X K1)", MLA, RUNS,
           shown_by="CPU: tests/vllm/test_models_e2e.py (TP=2 float32, tokens equal "
                    "unsharded, debug checks); GPU: benchmarks/results/"
                    "h100x1-2026-12-06-models (TP=2 graphs within the floor, 1.98x, "
                    "debug run)"),
    Family("dense-mla", ("KimiVLForConditionalGeneration", "KimiK25ForConditionalGeneration",
                         "Glm4MoeLiteMTPModel", "MistralLarge3ForCausalLM", "PanguUltraMoEForCausalLM",
                         "OpenPanguMTPModel", "LongcatFlashForCausalLM",
                         "LongcatFlashNgramForCausalLM", "LongCatFlashMTPModel",
                         "DeepseekVLV2ForCausalLM", "DeepseekOCRForCausalLM",
                         "DeepseekOCR2ForCausalLM"),
           "dense MLA on vLLM's MLA layer (LongCat: two per decoder layer; the VL/OCR "
           "models: a DeepSeek-V2 language model)", MLA, UNVERIFIED, needs=DENSE_NEEDS),
    Family("eagle", ("EagleDeepSeekMTPModel", "Eagle3DeepseekV2ForCausalLM",
                     "Eagle3DeepseekV3ForCausalLM", "EagleMistralLarge3ForCausalLM"),
           "EAGLE draft models with MLA layers", MLA, REFUSED,
           why="EAGLE drafting is not a speculative method cp_kv runs (row spec-method)",
           needs="the EAGLE drafter's hidden-state inputs checked under sharding, as MTP's "
                 "were"),
    Family("deepseek-v4", ("DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration",
                           "DeepSeekV4MTPModel", "DSparkDraftModel", "DeepseekV41ForCausalLM",
                           "DSparkV41DraftModel"),
           "sliding-window MLA on every layer, compressed MLA (ratio 4 with an indexer, "
           "128 without; V4.1: 1 or 2, shared across layers)",
           "SlidingWindowMLASpec (window and compressor state), MLAAttentionSpec with "
           "tokens_per_state > 1, CircularBufferSpec (V4.1)", REFUSED,
           why="sliding-window and compressed MLA caches (a window of recent tokens, "
               "several tokens a cache row) and DeepSeek-V4's compressed indexer, which "
               "block ownership does not cover",
           needs="ownership of compressed rows (a block of 64 rows is 256 or 8,192 tokens), "
                 "the window cache replicated, and the compressed indexer's top-k merged "
                 "across ranks (the sparse path of docs/sparse.md as the base)"),
    Family("dots3-note", ("Dots3NoteForCausalLM", "Dots3NoteMTPModel"),
           "sliding-window dense MLA layers beside DSA sparse MLA layers",
           f"SlidingWindowMLASpec; {MLA}; {INDEXER}", REFUSED,
           why="its sliding-window MLA layers (SlidingWindowMLASpec) beside the sparse ones",
           needs="the window layers kept unsharded (a layout per KV cache group) and the "
                 "DSA layers on the shard-aware sparse path"),
    Family("glm5-next", ("Glm5NextForCausalLM", "Glm5NextForConditionalGeneration",
                         "Glm5NextMTPModel"),
           f"{KDA} layers beside sparse MLA with a pooled indexer",
           f"MambaSpec; {MLA}; indexer MLAAttentionSpec with tokens_per_state = index_kpool; "
           "CircularBufferSpec (tail)", REFUSED,
           why=f"{KDA_WHY}, and its pooled indexer keeps one key per index_kpool tokens",
           needs=f"{KDA_NEEDS}; the pooled indexer's rows owned per pool and its top-k merged "
                 "as DSA's"),
    Family("kimi-linear", ("KimiLinearForCausalLM", "KimiK3ForConditionalGeneration",
                           "KimiK31ForConditionalGeneration", "KimiK3MTPModel", "K3DSparkModel"),
           f"{KDA} layers beside dense NoPE MLA (Kimi-K3: DSA layers too)",
           f"MambaSpec; {MLA}; {INDEXER} (K3)", REFUSED, why=KDA_WHY, needs=KDA_NEEDS),
    Family("bailing-hybrid", ("BailingMoeV2_5ForCausalLM", "BailingMoeV25MTPModel",
                              "BailingMoeV3ForCausalLM", "BailingMoeV3VLForConditionalGeneration",
                              "MingV3ASRForConditionalGeneration", "BailingMoeV3MTPModel"),
           "linear attention (V2.5) or KDA (V3) layers beside dense MLA", f"MambaSpec; {MLA}",
           REFUSED, why=KDA_WHY, needs=KDA_NEEDS),
    Family("hy-v4", ("HYV4ForCausalLM", "HYV4MTPModel"),
           "dense or DSA sparse MLA per layer, a learned attention sink, shared indexers",
           f"{MLA}; {INDEXER}", REFUSED,
           why="its learned attention sink, which a merge of per-rank partial outputs by "
               "LSE would count once per rank",
           needs="the sink added once to the merged LSE, and dense and sparse layers of one "
                 "model on their two paths"),
    Family("mistral-large-4", ("MistralLarge4ForCausalLM", "MistralLarge4DSparkModel"),
           "DSA sparse MLA, per-layer NoPE, layers reading another layer's KV cache",
           f"{MLA} (shared between layers); {INDEXER}; SlidingWindowMLASpec (DSpark)",
           REFUSED,
           why="layers that read another layer's KV cache (kv_source_layers) and share its "
               "indexer",
           needs="the shared cache's owned rows read by every layer that shares it, on the "
                 "shard-aware sparse path"),
    Family("sarvam-mla", ("SarvamMLAForCausalLM",), "dense MLA", MLA, REFUSED,
           why="vLLM 0.34 builds its MLA layers but reports use_mla false for it "
               "(sarvam_mla is missing from its list of MLA model types), so vLLM's DCP "
               "machinery, which sharding runs on, is off for it",
           needs="vLLM listing the model type as MLA; then the dense-mla family's run"),
)

# Architectures whose vLLM modules hold MLA code but whose attention is not
# MLA (vLLM's use_mla is false for them: the non-mla startup row refuses
# them like any non-MLA model)
NOT_MLA = {
    "DeepseekForCausalLM": "DeepSeek (V1): multi-head attention",
    "DeepseekV3BidirectionalModel": "an encoder (is_causal false): encoder-only attention",
    "PanguEmbeddedForCausalLM": "full or sink attention (MLA only where a config carries MLA "
                                "fields, and its model type is not one vLLM calls MLA)",
    "PanguProMoEV2ForCausalLM": "full or sink attention, as PanguEmbedded",
    "SarvamMoEForCausalLM": "grouped-query attention (its MLA sibling: SarvamMLAForCausalLM)",
    "MiniMaxM3SparseForCausalLM": "grouped-query attention; an MLAAttentionSpec holds only "
                                  "its indexer keys",
    "MiniMaxM3SparseForConditionalGeneration": "as MiniMaxM3SparseForCausalLM",
    "MiniMaxM3MTP": "as MiniMaxM3SparseForCausalLM",
    "Qwen4ExpForCausalLM": "grouped-query and gated-delta attention; an MLAAttentionSpec "
                           "holds only its QSA indexer keys",
    "Qwen4ExpForConditionalGeneration": "as Qwen4ExpForCausalLM",
    "Qwen4ExpMTP": "as Qwen4ExpForCausalLM",
}

ARCHITECTURES = {arch: fam for fam in FAMILIES for arch in fam.archs}
# the families whose MTP drafting ran sharded (checks.check_draft)
MTP_FAMILIES = ("deepseek-v2", "deepseek-v32")
assert len(ARCHITECTURES) == sum(len(f.archs) for f in FAMILIES), "an architecture twice"


def status_of(arch: str) -> str | None:
    """RUNS, UNVERIFIED or REFUSED; None for an architecture not in the table."""
    fam = ARCHITECTURES.get(arch)
    return None if fam is None else fam.status


def refusal(arch: str, allow_unverified: bool) -> str | None:
    """Why ``arch`` does not start sharded (the message after ``cp_kv: ``),
    or None where it does."""
    fam = ARCHITECTURES.get(arch)
    if fam is not None and fam.status == REFUSED:
        return (f"architecture {arch} is not supported with sharded KV: {fam.why}. "
                f"Disable cp_kv for this model (docs/models.md, family {fam.name}, says "
                "what supporting it would take).")
    if allow_unverified or (fam is not None and fam.status == RUNS):
        return None
    known = (f"its layers ({fam.layers}) keep only the MLA latent that cp_kv shards, but "
             if fam is not None else "it is not in cp_kv's table of MLA architectures "
             "(docs/models.md), and ")
    return (f"architecture {arch} has not run sharded with this release of vllm_cp_kv: "
            f"{known}no run has compared it with the unsharded model. Set "
            "cp_kv.allow_unverified_model=true to run it anyway (and compare its outputs "
            "with an unsharded run), or disable cp_kv.")


def spec_problem(spec) -> str | None:
    """What keeps a layer's KV cache spec from block ownership, or None:
    only the plain MLA latent (and DeepSeek-V3.2's indexer keys, an
    MLAAttentionSpec too) shard, one token a row, no window."""
    kind = type(spec).__name__
    if kind != "MLAAttentionSpec":
        return f"a {kind} cache"
    if getattr(spec, "sliding_window", None):
        return f"a sliding-window MLA cache (window {spec.sliding_window})"
    tokens = getattr(spec, "tokens_per_state", 1)
    if tokens != 1:
        return f"a compressed MLA cache ({tokens} tokens a row)"
    if getattr(spec, "attention_chunk_size", None):
        return f"a chunked-local MLA cache (chunks of {spec.attention_chunk_size})"
    if getattr(spec, "non_causal", False):
        return "a non-causal MLA cache"
    if getattr(spec, "model_version", None):
        return f"an MLA cache of model version {spec.model_version}"
    return None
