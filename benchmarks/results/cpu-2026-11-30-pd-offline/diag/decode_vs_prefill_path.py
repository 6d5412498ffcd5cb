"""Single vLLM instance: the token after P+t1 computed by the decode path
(generate 2 tokens from P) vs by the prefill path (prompt P+[t1])."""
import json, os, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
from vllm import LLM, SamplingParams, TokensPrompt
from vllm_cp_kv.tools.generate import prompts
def main():
    m, dtype, tp, backend, bs, mns = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5]), int(sys.argv[6])
    kw = dict(model=m, dtype=dtype, tensor_parallel_size=tp, max_model_len=1024, max_num_seqs=mns,
              block_size=bs, seed=0, enforce_eager=True)
    if backend != "none": kw["attention_config"] = {"backend": backend}
    if os.environ.get("NATIVE_ROPE"): kw["compilation_config"] = {"custom_ops": ["all", "-rotary_embedding"]}
    if len(sys.argv) > 7: kw["additional_config"] = {"cp_kv": {"enable": True}}
    llm = LLM(**kw)
    tok = llm.get_tokenizer()
    ids = [tok(p).input_ids for p in prompts(8)]
    sp = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=5)
    a = llm.generate([TokensPrompt(prompt_token_ids=i) for i in ids], sp(2))
    b = llm.generate([TokensPrompt(prompt_token_ids=i + [o.outputs[0].token_ids[0]]) for i, o in zip(ids, a)], sp(1))
    rows = []
    for i, (x, y) in enumerate(zip(a, b)):
        lx = x.outputs[0].logprobs[1]; ly = y.outputs[0].logprobs[0]
        common = set(lx) & set(ly)
        d = max((abs(lx[t].logprob - ly[t].logprob) for t in common), default=-1)
        top = sorted(lx.values(), key=lambda v: -v.logprob)
        rows.append(dict(p=i, len=len(ids[i]), t1=x.outputs[0].token_ids[0], decode_t2=x.outputs[0].token_ids[1],
                         prefill_t2=y.outputs[0].token_ids[0], maxdiff_logprob=round(d, 6),
                         margin=round(top[0].logprob - top[1].logprob, 4),
                     top_decode=[(t, round(v.logprob, 4)) for t, v in sorted(lx.items(), key=lambda kv: -kv[1].logprob)][:3],
                     top_prefill=[(t, round(v.logprob, 4)) for t, v in sorted(ly.items(), key=lambda kv: -kv[1].logprob)][:3]))
        print(rows[-1])
    print("PATHS", json.dumps(rows))

if __name__ == '__main__':
    main()
