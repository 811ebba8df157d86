"""python bench/bench_tile_copy.py [options]: the benchmark mla_kv.bench.tile_copy, as `mla-kv bench tile_copy`."""
import sys

from mla_kv.bench.tile_copy import main

if __name__ == "__main__":
    sys.exit(main())
