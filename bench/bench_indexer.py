"""python bench/bench_indexer.py [options]: the benchmark mla_kv.bench.indexer, as `mla-kv bench indexer`."""
import sys

from mla_kv.bench.indexer import main

if __name__ == "__main__":
    sys.exit(main())
