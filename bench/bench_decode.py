"""python bench/bench_decode.py [options]: the benchmark mla_kv.bench.decode, as `mla-kv bench decode`."""
import sys

from mla_kv.bench.decode import main

if __name__ == "__main__":
    sys.exit(main())
