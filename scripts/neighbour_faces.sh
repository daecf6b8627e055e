#!/bin/bash
# A 512 MiB neighbour through `empanel-gguf run`, llama-server and `empanel-gguf serve` (the
# [server] extra), in a memory cgroup of 40 % of
# the model file (root, cgroup v1): both live, the text equals a run without it, the budget moved
# (docs/reliability.md). Needs llama.cpp's programs (-DEMPANEL_PROGRAMS=ON).
set -u
cd "$(dirname "$0")/.."
M=${1:?usage: scripts/neighbour_faces.sh MODEL.gguf (the 12-layer bench model: bench --write-model M12.gguf --shape synthetic --layers 12)}
BASE=$(awk -F: '/memory/ {print $3}' /proc/self/cgroup)
CG=/sys/fs/cgroup/memory$BASE/empanel-faces
LIMIT=$(python3 -c "import os; print(int(0.4 * os.path.getsize('$M')))")
NB='import mmap, sys, time
m = mmap.mmap(-1, 512 << 20)
for i in range(0, 512 << 20, 4096): m[i] = 1
print("held", flush=True); time.sleep(float(sys.argv[1]))'
PROMPT="The history of the river towns is written in their bridges. Each generation built a crossing"
setup() { rmdir $CG 2>/dev/null; mkdir $CG; echo $LIMIT > $CG/memory.limit_in_bytes; sync; echo 3 > /proc/sys/vm/drop_caches; }
kills() { awk '/oom_kill / {print $2}' $CG/memory.oom_control; }
incg() { sh -c 'echo $$ > '$CG'/cgroup.procs; exec "$@"' sh "$@"; }

echo "== run, no neighbour"; setup
incg python -m empanel_gguf run $M --moe-slots auto -p "$PROMPT" -n 64 --temp 0 > /tmp/run-alone.out 2> /tmp/run-alone.err; echo "rc $? kills $(kills)"
echo "== run, a 512 MiB neighbour 6 s in, for 8 s"; setup
incg python -m empanel_gguf run $M --moe-slots auto -p "$PROMPT" -n 64 --temp 0 > /tmp/run-nb.out 2> /tmp/run-nb.err & P=$!
sleep 6; incg python3 -c "$NB" 8 & N=$!
wait $P; echo "run rc $?"; wait $N; echo "neighbour rc $? kills $(kills)"
cmp /tmp/run-alone.out /tmp/run-nb.out && echo "run: the same text"
grep -E "budget|decode" /tmp/run-nb.err | tail -3

# a server face: ask ($2, a request function) once alone, then again while the neighbour holds
# its memory; the same text, nobody killed, the budget's moves from its /metrics (port $3)
compare_with_neighbour() {
    $2 > /tmp/$1-alone.out
    (sleep 3; incg python3 -c "$NB" 8) & N=$!
    $2 > /tmp/$1-nb.out; wait $N; echo "neighbour rc $? kills $(kills)"
    cmp /tmp/$1-alone.out /tmp/$1-nb.out && echo "$1: the same text"
    curl -s localhost:$3/metrics | grep -E "^empanel_budget_(shrinks|grows|given_back|lowest|elastic)"
    kill $(cat $CG/cgroup.procs) 2>/dev/null; wait $S 2>/dev/null; sleep 2
    rmdir $CG
}

echo "== llama-server"; setup
incg python -m empanel_gguf llama-server -m $M --moe-slots auto --port 8091 -c 1024 -t 2 --metrics > /tmp/srv.out 2> /tmp/srv.err & S=$!
for i in $(seq 60); do curl -s localhost:8091/health | grep -q ok && break; sleep 1; done
req() { curl -s localhost:8091/completion -d "{\"prompt\": \"$PROMPT\", \"n_predict\": 64, \"temperature\": 0, \"cache_prompt\": false}" | python3 -c "import json,sys; print(json.load(sys.stdin)['content'])"; }
compare_with_neighbour llama-server req 8091

echo "== serve"; setup
incg python -m empanel_gguf serve $M --moe_slots auto --port 8092 --n_ctx 1024 --n_threads 2 > /tmp/serve.out 2> /tmp/serve.err & S=$!
for i in $(seq 90); do curl -s localhost:8092/v1/models | grep -q '"data"' && break; sleep 1; done
sreq() { curl -s localhost:8092/v1/completions -H 'Content-Type: application/json' -d "{\"prompt\": \"$PROMPT\", \"max_tokens\": 64, \"temperature\": 0}" | python3 -c "import json,sys; print(json.load(sys.stdin)['choices'][0]['text'])"; }
sreq > /dev/null  # (llama-cpp-python reuses the prompt it holds: both compared requests do)
compare_with_neighbour serve sreq 8092
