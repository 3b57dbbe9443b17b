#!/usr/bin/env bash
# .ci/background.sh [--idle] LOG COMMAND...: a step of .ci/run that runs beside the next ones.
# Runs COMMAND with its output in LOG, then writes "WALL_S CPU_S" (its wall time, and the CPU
# time of all its processes that it waited for) to LOG.time. .ci/run starts it under setsid, so
# that its session, and so its whole process group, is its own.
# --idle: COMMAND gets only the cores that the rest of CI leaves idle: its session's autogroup gets
# the lowest weight (nice 19) and COMMAND runs under SCHED_IDLE. A foreground step then gets the
# cores first, and one that times itself (the serial tests, the requeue check) is not starved. It
# still slows down where the two cores share execution units or caches: on a 2-core AMD EPYC the
# tests' parallel phase took 904 s alone and up to 1,130 s beside the reference checks.
idle=0
[[ $1 == --idle ]] && { idle=1; shift; }
log=$1
shift
if ((idle)); then
  echo 19 >/proc/self/autogroup 2>/dev/null || true  # kernels without autogroups: nice and SCHED_IDLE alone
  set -- chrt --idle 0 nice -n 19 "$@"
fi
start=$SECONDS
status=0
"$@" >"$log" 2>&1 || status=$?
times >"$log.times"  # a builtin with a redirection runs in this shell: line 2 is its children's CPU time
cpu=$(awk 'NR == 2 { for (i = 1; i <= 2; i++) { split($i, t, "m"); s += t[1] * 60 + t[2] } }
           END { printf "%d", s + 0.5 }' "$log.times")
echo "$((SECONDS - start)) $cpu" >"$log.time"
exit $status
