"""python bench/bench_expanded.py [options]: the benchmark mla_kv.bench.expanded, as `mla-kv bench expanded`."""
import sys

from mla_kv.bench.expanded import main

if __name__ == "__main__":
    sys.exit(main())
