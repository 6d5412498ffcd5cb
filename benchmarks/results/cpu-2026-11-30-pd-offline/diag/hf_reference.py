import torch, json, sys
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm_cp_kv.tools.generate import prompts
m = sys.argv[1]
tok = AutoTokenizer.from_pretrained(m)
ref = json.load(open(sys.argv[2]))["tokens"] if len(sys.argv) > 2 else None
res = {}
for dt in (torch.float64, torch.float32, torch.bfloat16):
    model = AutoModelForCausalLM.from_pretrained(m, dtype=dt, experts_implementation="eager").eval()
    out = []
    for p in prompts(8):
        ids = tok(p, return_tensors="pt").input_ids
        with torch.no_grad():
            lg = model(ids).logits[0, -1].double()
        out.append(lg)
    res[dt] = out
for i in range(8):
    l64 = res[torch.float64][i]; top = torch.topk(l64, 2).values
    line = [f"p{i} len? margin64={float(top[0]-top[1]):.3g} argmax64={int(l64.argmax())}"]
    for dt in (torch.float32, torch.bfloat16):
        l = res[dt][i]
        line.append(f"{str(dt)[6:]}: argmax={int(l.argmax())} maxabsdiff={float((l-l64).abs().max()):.3g}")
    if ref: line.append(f"vllm_ref_first={ref[i][0]}")
    print(" | ".join(line))
