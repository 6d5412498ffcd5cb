"""Every architecture of docs/models.md that does not run sharded, put
through vLLM's own startup path with cp_kv on (issue 53): each must be
refused by cp_kv's check with a message naming it, before any weight loads.

Usage (on the GPU machine, vLLM 0.34 with the plugin registered; here too on
the CPU's vLLM):

    python3 benchmarks/gpu_arch_sweep.py OUT      # writes OUT/sweep.json

For each architecture a directory holds the tiny tokenizer and a
config.json of the architecture's own model type (``MODEL_TYPES``; 2 layers,
the config class fills the rest; ``stand-in``: DeepSeek-V3's type where the
released checkpoints carry no config class of their own). Then ``EngineArgs(model, tp=2, cp_kv on).create_engine_config()``, the call
``vllm serve`` and ``LLM`` make, must raise cp_kv's error naming the
architecture and its family's reason (refused) or "has not run sharded"
(unverified). Controls: ``DeepseekV3ForCausalLM`` (a family that runs)
passes the check, and an unverified architecture starts its config with
``allow_unverified_model``.
"""

from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from gpu_models import refusal_said  # noqa: E402
from vllm_cp_kv.integration import models  # noqa: E402

# architecture -> the model type of its released configs (None: no config
# class outside the checkpoint's own files: the stand-in)
MODEL_TYPES = {
    "KimiVLForConditionalGeneration": "kimi_vl",
    "KimiK25ForConditionalGeneration": "kimi_k25",
    "Glm4MoeLiteMTPModel": "glm4_moe_lite",
    "MistralLarge3ForCausalLM": None,  # mistral-format checkpoints
    "PanguUltraMoEForCausalLM": None, "OpenPanguMTPModel": None,
    "LongcatFlashForCausalLM": "longcat_flash", "LongcatFlashNgramForCausalLM": "longcat_flash",
    "LongCatFlashMTPModel": "longcat_flash",
    "DeepseekVLV2ForCausalLM": "deepseek_vl_v2", "DeepseekOCRForCausalLM": "deepseek_vl_v2",
    "DeepseekOCR2ForCausalLM": "deepseek_ocr2",
    "EagleDeepSeekMTPModel": None, "Eagle3DeepseekV2ForCausalLM": None,
    "Eagle3DeepseekV3ForCausalLM": None, "EagleMistralLarge3ForCausalLM": None,
    "DeepseekV4ForCausalLM": "deepseek_v4", "DeepseekV4ForConditionalGeneration": "deepseek_v4",
    "DeepSeekV4MTPModel": "deepseek_v4", "DSparkDraftModel": "deepseek_v4",
    "DeepseekV41ForCausalLM": "deepseek_v41", "DSparkV41DraftModel": "deepseek_v41",
    "Dots3NoteForCausalLM": "dots3_note", "Dots3NoteMTPModel": "dots3_note",
    "Glm5NextForCausalLM": "glm5_next", "Glm5NextForConditionalGeneration": "glm5_next",
    "Glm5NextMTPModel": "glm5_next",
    "KimiLinearForCausalLM": "kimi_linear", "KimiK3ForConditionalGeneration": "kimi_k3",
    "KimiK31ForConditionalGeneration": "kimi_k31", "KimiK3MTPModel": "kimi_k3",
    "K3DSparkModel": "k3_dspark",
    "BailingMoeV2_5ForCausalLM": "bailing_moe_linear", "BailingMoeV25MTPModel": "bailing_moe_linear",
    "BailingMoeV3ForCausalLM": "bailing_moe_v3",
    "BailingMoeV3VLForConditionalGeneration": "bailing_moe_v3_vl",
    "MingV3ASRForConditionalGeneration": "ming_v3_asr", "BailingMoeV3MTPModel": "bailing_moe_v3",
    "HYV4ForCausalLM": "hy_v4", "HYV4MTPModel": "hy_v4",
    "MistralLarge4ForCausalLM": "mistral4", "MistralLarge4DSparkModel": "mistral4",
    "SarvamMLAForCausalLM": "sarvam_mla",
}
STAND_IN = "deepseek_v3"


def config_dir(root: str, arch: str, model_type: str) -> str:
    """The tiny tokenizer and ``{"model_type", "architectures"}`` (2 layers):
    the config class of ``model_type`` fills the rest."""
    from vllm_cp_kv.tools.tiny_model import build_tokenizer

    path = os.path.join(root, f"{model_type}-{arch}")
    os.makedirs(path, exist_ok=True)
    build_tokenizer(700).save_pretrained(path)
    cfg = {"model_type": model_type, "architectures": [arch], "num_hidden_layers": 2,
           "torch_dtype": "bfloat16"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def start(path: str, allow: bool = False) -> str | None:
    """vLLM's startup config path with cp_kv on, TP=2: None where it
    passed, else the error's ``Type: message``."""
    from vllm.engine.arg_utils import EngineArgs

    cp_kv = {"enable": True, **({"allow_unverified_model": True} if allow else {})}
    args = EngineArgs(model=path, tensor_parallel_size=2, max_model_len=4096,
                      additional_config={"cp_kv": cp_kv}, trust_remote_code=False)
    try:
        args.create_engine_config()
    except Exception as e:  # noqa: BLE001 - recorded, judged below
        return f"{type(e).__name__}: {e}"
    return None


def judged(arch: str, err: str | None) -> bool:
    """cp_kv's own error (not vLLM's), naming ``arch`` and its reason."""
    return bool(err and err.startswith("CPKVConfigError: ") and refusal_said(err, arch))


def sweep(root: str) -> dict:
    rows = {}
    for fam in models.FAMILIES:
        if fam.status == models.RUNS:
            continue
        for arch in fam.archs:
            t = time.perf_counter()
            row = {"family": fam.name, "status": fam.status, "row": fam.row}
            mt = MODEL_TYPES.get(arch) or STAND_IN
            row["config"] = mt if MODEL_TYPES.get(arch) else f"stand-in ({mt})"
            err = start(config_dir(root, arch, mt))
            row.update(message=err, ok=judged(arch, err),
                       seconds=round(time.perf_counter() - t, 1))
            rows[arch] = row
            print(arch, row["config"], "ok" if row["ok"] else f"FAIL {err}", flush=True)
    return rows


def controls(root: str) -> dict:
    """A family that runs passes cp_kv's check; an unverified one with the
    option passes it too (each may fail later in vLLM's own config checks,
    which are not cp_kv's: recorded)."""
    out = {}
    for name, arch, allow in (("runs-passes", "DeepseekV3ForCausalLM", False),
                              ("unverified-with-option", "LongcatFlashForCausalLM", True)):
        err = start(config_dir(root, arch, STAND_IN), allow)
        out[name] = {"arch": arch, "message": err,
                     "ok": not (err or "").startswith("CPKVConfigError")}
    return out


def main() -> None:
    out = sys.argv[1]
    root = os.path.join(out, "configs")
    os.makedirs(root, exist_ok=True)
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # cp_kv's patch of EngineArgs, as vllm serve loads it
    import vllm

    rows, ctl = sweep(root), controls(root)
    res = {"vllm": vllm.__version__, "architectures": rows, "controls": ctl,
           "ok": all(r["ok"] for r in rows.values()) and all(c["ok"] for c in ctl.values())}
    with open(os.path.join(out, "sweep.json"), "w") as f:
        json.dump(res, f, indent=1)
    own = sum(1 for r in rows.values() if not r["config"].startswith("stand-in"))
    print(json.dumps({"ok": res["ok"], "architectures": len(rows), "own_config": own,
                      "failed": [a for a, r in rows.items() if not r["ok"]],
                      "controls": {k: v["ok"] for k, v in ctl.items()}}, indent=1))


if __name__ == "__main__":
    main()
