"""python bench/bench_sparse.py [options]: the benchmark mla_kv.bench.sparse, as `mla-kv bench sparse`."""
import sys

from mla_kv.bench.sparse import main

if __name__ == "__main__":
    sys.exit(main())
