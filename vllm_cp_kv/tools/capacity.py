"""Print the KV capacity table: DeepSeek-V3 tokens, sharded vs replicated.

Usage: python -m vllm_cp_kv.tools.capacity [--kv-gib 64] [--scratch-tokens 262144]
"""

import argparse

from ..core.capacity import capacity_table, format_table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-gib", type=float, default=64, help="KV memory per GPU")
    ap.add_argument("--scratch-tokens", type=int, default=256 * 1024,
                    help="tokens of one layer's full view (double-buffered)")
    a = ap.parse_args()
    print(f"KV budget {a.kv_gib:g} GiB per rank, scratch 2 x {a.scratch_tokens:,} tokens "
          "of one layer (counted in the budget)")
    print(format_table(capacity_table(int(a.kv_gib * 2**30), a.scratch_tokens)))


if __name__ == "__main__":
    main()
