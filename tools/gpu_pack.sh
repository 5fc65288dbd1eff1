#!/bin/bash
# Packs the built library for the lent GPU host: gzipped into .carry (the tree,
# the .debs and the library together must stay under the 64 MiB carry limit).
# Carry then: build/ffi_cdef.lua build/ffi_probe .debs .carry
set -e
mkdir -p .carry
gzip -1 -c build/libmoonshard.so > .carry/libmoonshard.so.gz
ls -la .carry/libmoonshard.so.gz
