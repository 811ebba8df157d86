"""python bench/profile_decode.py B CTX H [dtype] | --times: mla_kv.bench.profile_decode, as mla-kv bench."""
import sys

from mla_kv.bench.profile_decode import main

if __name__ == "__main__":
    sys.exit(main())
