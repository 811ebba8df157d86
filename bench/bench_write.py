"""python bench/bench_write.py [options]: the benchmark mla_kv.bench.write, as `mla-kv bench write`."""
import sys

from mla_kv.bench.write import main

if __name__ == "__main__":
    sys.exit(main())
