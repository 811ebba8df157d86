"""python bench/bench_gather.py [options]: the benchmark mla_kv.bench.gather, as `mla-kv bench gather`."""
import sys

from mla_kv.bench.gather import main

if __name__ == "__main__":
    sys.exit(main())
