#!/usr/bin/env bash
# The LD_PRELOAD vLLM's CPU docs ask for (tcmalloc, then Intel OpenMP), for this checkout's
# venv; prints nothing for a library that is missing.
#   export LD_PRELOAD=$(bash scripts/cpu_env.sh)
cd "$(dirname "$0")/.."
libs=()
tcm=$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 /{print $NF; exit}')
[ -n "$tcm" ] && libs+=("$tcm")
[ -f .venv/lib/libiomp5.so ] && libs+=("$PWD/.venv/lib/libiomp5.so")
(IFS=:; echo "${libs[*]}")
