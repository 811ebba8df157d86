"""python bench/bench_cp.py [options]: the benchmark mla_kv.bench.cp, as `mla-kv bench cp`."""
import sys

from mla_kv.bench.cp import main

if __name__ == "__main__":
    sys.exit(main())
