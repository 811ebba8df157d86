"""python bench/bench_unequal.py [options]: the benchmark mla_kv.bench.unequal, as `mla-kv bench unequal`."""
import sys

from mla_kv.bench.unequal import main

if __name__ == "__main__":
    sys.exit(main())
