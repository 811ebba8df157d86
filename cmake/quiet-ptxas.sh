#!/bin/sh
# The CUDA compiler launcher of the kernel targets (CMakeLists.txt says why): runs the compile command it
# is given and passes on what it prints to stderr, less ptxas's C7519 notes ("warpgroup.arrive is injected
# ... in function ..."), which are harmless here. Exit status and every other line are the compile's.
log=$(mktemp "${TMPDIR:-/tmp}/mla_kv_ptxas.XXXXXX") || exec "$@"
"$@" 2>"$log"
status=$?
grep -v -e '(C7519) warpgroup\.arrive is injected' "$log" >&2
rm -f "$log"
exit $status
