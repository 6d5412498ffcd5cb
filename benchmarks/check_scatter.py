"""Quick GPU check: Triton scatter_rows against torch for block, random and mixed slots."""
import torch
from vllm_cp_kv.core.kernels import scatter_rows, indexer_views
dev="cuda"
torch.manual_seed(0)
ok=True
for bs, D, dt in ((64,576,torch.bfloat16),(64,656,torch.uint8)):
    for pattern in ("blocks","random","mixed"):
        cache=torch.randint(0,100,(300,bs,D),device=dev).to(dt)
        n=777
        if pattern=="blocks":
            blocks=torch.randperm(300,device=dev)[:13]
            slots=(blocks[:,None]*bs+torch.arange(bs,device=dev)).flatten()[:n]
        elif pattern=="random":
            slots=torch.randperm(300*bs,device=dev)[:n]
        else:
            slots=(torch.arange(n,device=dev)+5); slots[::7]=-1
        rows=torch.randint(0,100,(slots.numel(),D),device=dev).to(dt)
        a=cache.clone(); b=cache.clone()
        scatter_rows(a,slots,rows,use_triton=True); scatter_rows(b,slots,rows,use_triton=False)
        ok &= torch.equal(a,b); print(pattern, D, torch.equal(a,b))
c=torch.randint(0,255,(50,64*132),device=dev,dtype=torch.uint8); c2=c.clone()
for cc,tri in ((c,True),(c2,False)):
    k,s_=indexer_views(cc,64); sl=torch.arange(100,300,device=dev); sl[::9]=-1
    scatter_rows(k,sl,torch.full((200,128),7,device=dev,dtype=torch.uint8),use_triton=tri)
    scatter_rows(s_,sl,torch.full((200,4),9,device=dev,dtype=torch.uint8),use_triton=tri)
print("indexer", torch.equal(c,c2)); ok&=torch.equal(c,c2)
print("ALL", ok)
