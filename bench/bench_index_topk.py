"""python bench/bench_index_topk.py [options]: the benchmark mla_kv.bench.index_topk, as `mla-kv bench index_topk`."""
import sys

from mla_kv.bench.index_topk import main

if __name__ == "__main__":
    sys.exit(main())
