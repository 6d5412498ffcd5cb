import torch
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.config import VllmConfig, set_current_vllm_config
ctx = set_current_vllm_config(VllmConfig()); ctx.__enter__()
def manual(x, pos):  # x [T, h, 64], GPT-J interleaved
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    ang = pos[:, None].double() * inv[None]
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    xe, xo = x[..., 0::2].double(), x[..., 1::2].double()
    out = torch.empty_like(x, dtype=torch.float64)
    out[..., 0::2] = xe * c - xo * s; out[..., 1::2] = xo * c + xe * s
    return out
torch.manual_seed(0)
dt = torch.float32
rope = get_rope(64, max_position=4096, is_neox_style=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, dtype=dt)
T, H = 37, 6
pos = torch.arange(T) + 5
q = torch.randn(T, H, 96, dtype=dt); kv = torch.randn(T, 576, dtype=dt)
qref, kref = manual(q[..., 32:], pos), manual(kv[:, 512:].unsqueeze(1), pos)
def err(a, b): return float((a.double() - b).abs().max())
for name, fn in (("cpu", rope.forward_cpu), ("native", rope.forward_native)):
    # MLA call: non-contiguous views
    q1, kv1 = q.clone(), kv.clone()
    qo, ko = fn(pos, q1[..., 32:], kv1[:, 512:].unsqueeze(1))
    # contiguous
    qo2, ko2 = fn(pos, q[..., 32:].contiguous(), kv[:, 512:].unsqueeze(1).contiguous())
    print(name, "views: q", err(qo, qref), "k", err(ko.reshape(T, 1, 64), kref), "kv_c clobbered", err(kv1[:, :512], kv[:, :512].double()),
          "| contiguous: q", err(qo2, qref), "k", err(ko2.reshape(T, 1, 64), kref))
