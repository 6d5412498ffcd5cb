"""Engine steps of two 2,000-token prefills at a time (TP=2, bf16, CPU):
usage: prefill_time.py unsharded|sharded MODEL_DIR (a one-off diagnostic of
the serving breakdown; not a benchmark of its own)."""
import sys, time, json

from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm_cp_kv.tools.offline import build_llm
from vllm_cp_kv.tools.tiny_model import token_prompts
def main():
    sharded = sys.argv[1] == "sharded"
    llm = build_llm(sys.argv[2], tp=2, dtype="bfloat16", eager=True,
                    rope="torch", cp_kv={} if sharded else None, max_model_len=2200,
                    max_num_seqs=8, enable_prefix_caching=False)
    eng = llm.llm_engine
    vocab = eng.vllm_config.model_config.get_vocab_size()
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for rnd in range(3):
        for i, ids in enumerate(token_prompts([2000] * 2, vocab, seed=rnd)):
            eng.add_request(f"{rnd}-{i}", TokensPrompt(prompt_token_ids=ids), sp)
        ts = []
        while eng.has_unfinished_requests():
            t0 = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t0)
        print("ROUND", rnd, ["%.3f" % t for t in ts], flush=True)

if __name__ == '__main__':
    main()
