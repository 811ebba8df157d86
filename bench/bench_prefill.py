"""python bench/bench_prefill.py [options]: the benchmark mla_kv.bench.prefill, as `mla-kv bench prefill`."""
import sys

from mla_kv.bench.prefill import main

if __name__ == "__main__":
    sys.exit(main())
