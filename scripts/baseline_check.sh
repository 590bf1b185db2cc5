#!/usr/bin/env bash
# The benchmark's "AR" against plain vLLM bound by VLLM_CPU_OMP_THREADS_BIND=0, measured by
# scripts/plain_decode.py (no code shared with the benchmark), alternated N times on the
# same 6 chat prompts. Usage: bash scripts/baseline_check.sh [N]   (~2.5 min per round)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-3}
T=${TARGET:-$HOME/.cache/vllm_saguaro/target}
D=${DRAFT:-$HOME/.cache/vllm_saguaro/draft}
export HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled VLLM_CPU_KVCACHE_SPACE=2
tmp=$(mktemp -d)
.venv/bin/python -c "
import json, sys; sys.path.insert(0, 'scripts'); import plain_decode as p
print(''.join(json.dumps({'set': 'plain6', 'prompt': x, 'chat': True}) + '\n' for x in p.PROMPTS), end='')
" > "$tmp/prompts.jsonl"
for i in $(seq "$N"); do
  VLLM_CPU_OMP_THREADS_BIND=0 .venv/bin/python scripts/plain_decode.py --target "$T" --runs 1 \
      --eager --label "plain bind0" 2>/dev/null | grep -a "^{"
  .venv/bin/python -m benchmarks.run --quick --systems AR --batches 1 --max-tokens 65 \
      --prompts-file "$tmp/prompts.jsonl" --target "$T" --draft "$D" --out "$tmp/run$i" \
      > "$tmp/run$i.log" 2>&1
  .venv/bin/python -c "import json; r = json.load(open('$tmp/run$i/latest.json'))['records'][0]; \
print(json.dumps({'label': 'benchmark AR', 'tok_s_seq': round(r['tok_s_seq'], 2), \
'cores': r['placement']['target']['busy_cores']}))"
done
