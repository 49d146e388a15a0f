# shellcheck shell=bash
# What every slurm/*.sbatch script shares: environment, head node, launch, pre-emption, requeue.
# Sourced by the scripts, never run by itself. No training logic here: a script is #SBATCH
# headers + `dspark_launch <subcommand> [args]` + `dspark_finish`.
#
# Tunables (environment; `VAR=value sbatch ...` or `sbatch --export=ALL,VAR=value ...`):
#   DSPARK_LAUNCHER      srun (default): one task per GPU, rank / local rank / world size from
#                        SLURM_* | torchrun: one `torchrun` per node (c10d rendezvous on the head
#                        node); submit with --ntasks-per-node=1 then
#   DSPARK_NPROC_PER_NODE  torchrun workers per node (default: GPUs on the node, else tasks/node)
#   DSPARK_WORKDIR       directory the job runs in (default: where sbatch was called)
#   PYTHON               interpreter with dspark-ds installed (default: python3)
#   MASTER_ADDR          rendezvous host (default: the first node's address as the other nodes
#                        reach it, resolved here once; under torchrun its name, which torchrun
#                        matches to the host that serves the rendezvous; when DSPARK_SRUN_ARGS
#                        narrows the step's nodes, each task takes the first node of its step)
#   MASTER_PORT          rendezvous port (default: derived from the job id, below the kernel's
#                        ephemeral range, the next free one when it is taken here)
#   DSPARK_IFNAME        network interface of the ranks (default: the one that routes to
#                        MASTER_ADDR; exported as GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME)
#   DSPARK_EXIT_FILE     where rank 0 records why training stopped (default
#                        <workdir>/.dspark/<job id>.exit): a requeue asked for under torchrun,
#                        whose own exit code is 1, is still requeued
#   DSPARK_SRUN_ARGS     extra srun options (e.g. "--cpu-bind=cores")
#   DSPARK_TORCHRUN_ARGS extra torchrun options
#   DSPARK_MAX_REQUEUES  give up requeueing after this many restarts (default 20)
#   DSPARK_FORWARD_SIGNAL  signal passed on to the job step's tasks on Slurm's USR1 warning
#                        (default: USR1 under srun; TERM under torchrun, which passes TERM on
#                        to its workers and waits up to 30 s for them to save and exit)
#   DSPARK_SERVE_WAIT_S  the longest the servers of `dspark_serve_start` may take to answer
#                        /health, all together (default 1800)
#
# Pre-emption: `#SBATCH --signal=B:USR1@<s>` sends USR1 to this batch shell <s> seconds before
# the time limit (`scancel --signal=USR1 --batch <job>` does the same by hand). The shell passes
# it to the job step; the trainer checkpoints at the end of its step and exits 75
# (DSPARK_REQUEUE_EXIT_CODE); `dspark_finish` then runs `scontrol requeue`, and the requeued job
# (same job id, SLURM_RESTART_COUNT + 1) resumes from `latest` into the same MLflow run.
# `scontrol requeue <job>` from outside works too: Slurm sends TERM, the trainer checkpoints the
# same way, and Slurm itself puts the job back in the queue.

: "${DSPARK_LAUNCHER:=srun}"
: "${PYTHON:=python3}"
: "${DSPARK_WORKDIR:=${SLURM_SUBMIT_DIR:-$PWD}}"
: "${DSPARK_MAX_REQUEUES:=20}"
: "${DSPARK_REQUEUE_EXIT_CODE:=75}"
: "${DSPARK_SRUN_ARGS:=}"
: "${DSPARK_TORCHRUN_ARGS:=}"
: "${DSPARK_SERVE_WAIT_S:=1800}"

_dspark_child=""
_dspark_preempted=0
_dspark_stopped=0

_dspark_log() { echo "[slurm $(date +%T)] $*" >&2; }

_dspark_on_usr1() {
  _dspark_preempted=1
  _dspark_log "USR1: pre-emption / time-limit warning; the job step checkpoints and stops"
  if [[ -n $_dspark_child ]]; then
    # NOTE: `scancel --signal` (no --batch) reaches every task of every step on every node
    # without stopping them. Signalling srun itself would not do for torchrun: srun answers a
    # TERM by killing the step, before anything is saved.
    scancel --signal="$DSPARK_FORWARD_SIGNAL" "$_dspark_signal_job" 2>/dev/null ||
      kill -s "$DSPARK_FORWARD_SIGNAL" "$_dspark_child" 2>/dev/null || true
  fi
}

_dspark_on_term() {
  _dspark_stopped=1
  # NOTE: Slurm sends the same TERM to every process of the job steps itself (then KILL after
  # KillWait); passing it to srun too would make srun kill the step before it has saved.
  _dspark_log "TERM: Slurm is stopping the job (scancel / scontrol requeue / time limit)"
}

# NOTE: trap first: a USR1 that reaches a shell without a handler kills it outright.
trap _dspark_on_usr1 USR1
trap _dspark_on_term TERM

if [[ -z ${SLURM_JOB_ID:-} ]]; then
  echo "this is an sbatch script: submit it with 'sbatch $0 ...'" >&2
  exit 2
fi

case $DSPARK_LAUNCHER in
  srun) : "${DSPARK_FORWARD_SIGNAL:=USR1}" ;;
  torchrun) : "${DSPARK_FORWARD_SIGNAL:=TERM}" ;;
  *) echo "DSPARK_LAUNCHER must be srun or torchrun, got '$DSPARK_LAUNCHER'" >&2; exit 2 ;;
esac

cd "$DSPARK_WORKDIR"

# what the user set, for `dspark_het_group` (which sizes the launch again for another component)
_dspark_user_nproc=${DSPARK_NPROC_PER_NODE:-}
_dspark_user_omp=${OMP_NUM_THREADS:-}
_dspark_signal_job=$SLURM_JOB_ID  # whose steps the USR1 warning is passed on to
_dspark_nodelist=$SLURM_JOB_NODELIST

_dspark_nodes=${SLURM_JOB_NUM_NODES:-${SLURM_NNODES:-1}}
_dspark_tasks_per_node=${SLURM_NTASKS_PER_NODE:-$(( ${SLURM_NTASKS:-1} / _dspark_nodes ))}
: "${DSPARK_NPROC_PER_NODE:=${SLURM_GPUS_ON_NODE:-$_dspark_tasks_per_node}}"
_dspark_cpus_per_task=${SLURM_CPUS_PER_TASK:-1}
if [[ $DSPARK_LAUNCHER == torchrun ]]; then
  # one torchrun per node holds all of the node's CPUs; its workers share them
  _dspark_cpus_per_task=${SLURM_CPUS_ON_NODE:-$_dspark_cpus_per_task}
  : "${OMP_NUM_THREADS:=$(( _dspark_cpus_per_task / DSPARK_NPROC_PER_NODE > 0 ? _dspark_cpus_per_task / DSPARK_NPROC_PER_NODE : 1 ))}"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$_dspark_cpus_per_task}"

mapfile -t _dspark_hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
_dspark_user_master_addr=${MASTER_ADDR:-}
: "${MASTER_PORT:=$("$PYTHON" -m dspark_ds.network port "$SLURM_JOB_ID")}"
[[ -n $MASTER_PORT ]] || exit 1
export MASTER_PORT
: "${DSPARK_EXIT_FILE:=$DSPARK_WORKDIR/.dspark/$SLURM_JOB_ID.exit}"
export DSPARK_EXIT_FILE

# The head (MASTER_ADDR) of the next step, unless the user set it: the first node's address as
# the other nodes reach it, resolved here once (a node whose own name resolves to 127.0.1.1, as
# Debian writes it, is given the address it uses towards a peer). A step that DSPARK_SRUN_ARGS
# narrows to other nodes (-w, -x, -N, -r) gets no MASTER_ADDR: each task then takes the first
# node of its own step.
_dspark_head() {
  unset MASTER_ADDR
  if [[ -n $_dspark_user_master_addr ]]; then
    export MASTER_ADDR=$_dspark_user_master_addr
  elif [[ $DSPARK_LAUNCHER == torchrun ]]; then
    # NOTE: torchrun's c10d rendezvous is served by the agent whose host matches the endpoint;
    # it compares names and the addresses the host's own name resolves to, so a name works
    # where an address would match no host on a node with the 127.0.1.1 line.
    export MASTER_ADDR=${_dspark_hosts[0]}
  elif ! [[ " $DSPARK_SRUN_ARGS " =~ \ (-w|--nodelist|-x|--exclude|-N|--nodes|-r|--relative)[=\ ] ]]; then
    MASTER_ADDR=$("$PYTHON" -m dspark_ds.network head-address "${_dspark_hosts[@]}") || return 1
    export MASTER_ADDR
  fi
}

# dspark_launch <subcommand> [args...]: run `dspark-ds <subcommand> [args...]` on every rank of
# the allocation and wait for it (signals keep arriving while it runs). Sets DSPARK_RC.
dspark_launch() {
  local cmd
  _dspark_head
  if [[ $DSPARK_LAUNCHER == srun ]]; then
    # shellcheck disable=SC2086  # DSPARK_SRUN_ARGS is a list of options
    # NOTE: --cpus-per-task explicitly: srun of Slurm 22.05 to 23.02 does not take it from the
    # allocation (SLURM_CPUS_PER_TASK), so each task would get one CPU while OMP_NUM_THREADS
    # says more.
    cmd=(srun --kill-on-bad-exit=1 --cpus-per-task="$_dspark_cpus_per_task" $DSPARK_SRUN_ARGS
         "$PYTHON" -m dspark_ds.launch "$@")
  else
    # shellcheck disable=SC2086
    cmd=(srun --nodes="$_dspark_nodes" --ntasks="$_dspark_nodes" --ntasks-per-node=1
         --cpus-per-task="$_dspark_cpus_per_task" --kill-on-bad-exit=1 $DSPARK_SRUN_ARGS
         "$PYTHON" -m torch.distributed.run --nnodes="$_dspark_nodes"
         --nproc_per_node="$DSPARK_NPROC_PER_NODE" --rdzv_backend=c10d
         --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv_id="$SLURM_JOB_ID"
         $DSPARK_TORCHRUN_ARGS -m dspark_ds.launch "$@")
  fi
  _dspark_log "job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}: $_dspark_nodes node(s)" \
    "[$_dspark_nodelist], launcher $DSPARK_LAUNCHER, head ${MASTER_ADDR:-<first node of the step>}:$MASTER_PORT," \
    "$_dspark_cpus_per_task CPU(s) per task, OMP_NUM_THREADS=$OMP_NUM_THREADS"
  mkdir -p "$(dirname "$DSPARK_EXIT_FILE")"
  rm -f "$DSPARK_EXIT_FILE"
  _dspark_log "${cmd[*]}"
  if (( _dspark_preempted )); then
    _dspark_log "pre-empted before the launch; not starting"
    DSPARK_RC=$DSPARK_REQUEUE_EXIT_CODE
    return 0
  fi
  "${cmd[@]}" &
  _dspark_child=$!
  # NOTE: `wait` returns early (status > 128) whenever a trapped signal arrives; keep waiting
  # until the step is really gone, then collect its own exit status.
  while kill -0 "$_dspark_child" 2>/dev/null; do
    wait "$_dspark_child" 2>/dev/null || true
  done
  DSPARK_RC=0
  wait "$_dspark_child" 2>/dev/null || DSPARK_RC=$?
  _dspark_child=""
  _dspark_log "job step exited with $DSPARK_RC"
}

# dspark_finish: requeue after a pre-emption checkpoint, otherwise exit with the step's status.
dspark_finish() {
  local rc=${DSPARK_RC:-1}
  local asked
  # torchrun exits 1 whatever its workers' codes were: the trainer's own record says why
  if (( rc != 0 && rc != DSPARK_REQUEUE_EXIT_CODE )) && [[ -s $DSPARK_EXIT_FILE ]]; then
    asked=$(sed -n 's/.*"code": *\([0-9]*\).*/\1/p' "$DSPARK_EXIT_FILE")
    if [[ $asked == "$DSPARK_REQUEUE_EXIT_CODE" ]]; then
      _dspark_log "the job step exited with $rc; rank 0 asked for a requeue: $(cat "$DSPARK_EXIT_FILE")"
      rc=$asked
    fi
  fi
  if (( _dspark_stopped )); then
    _dspark_log "stopped by Slurm; exit $rc (Slurm requeues the job itself after scontrol requeue)"
    exit "$rc"
  fi
  if (( rc == DSPARK_REQUEUE_EXIT_CODE )) || { (( _dspark_preempted )) && (( rc != 0 )); }; then
    local restarts=${SLURM_RESTART_COUNT:-0}
    if (( restarts >= DSPARK_MAX_REQUEUES )); then
      _dspark_log "not requeueing: already restarted $restarts times (DSPARK_MAX_REQUEUES)"
      exit "$rc"
    fi
    _dspark_log "requeueing job $SLURM_JOB_ID (restart $((restarts + 1)))"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
  fi
  exit "$rc"
}

# dspark_het_group <n>: the next `dspark_launch` runs on component <n> of a heterogeneous job
# (`#SBATCH hetjob`, or `sbatch <options> : <options>`) instead of component 0, where the batch
# script runs: that component's nodes (its first one the head), tasks, CPUs and GPUs, srun given
# --het-group=<n>, and the USR1 warning passed on to that component's steps only.
dspark_het_group() {
  local n=$1 v nodelist ntasks gpus on_node
  v=SLURM_JOB_NODELIST_HET_GROUP_$n
  nodelist=${!v:-}
  if [[ -z $nodelist ]]; then
    echo "this job has no heterogeneous component $n ($v is unset): submit it as" \
      "'sbatch <options> : <options> $0' or with '#SBATCH hetjob' lines" >&2
    exit 2
  fi
  mapfile -t _dspark_hosts < <(scontrol show hostnames "$nodelist")
  _dspark_nodelist=$nodelist
  _dspark_nodes=${#_dspark_hosts[@]}
  v=SLURM_NTASKS_HET_GROUP_$n
  ntasks=${!v:-$_dspark_nodes}
  v=SLURM_NTASKS_PER_NODE_HET_GROUP_$n
  _dspark_tasks_per_node=${!v:-$(( ntasks / _dspark_nodes ))}
  v=SLURM_GPUS_PER_NODE_HET_GROUP_$n  # "8", "gpu:8" or "gpu:h100:8"
  gpus=${!v:-}
  gpus=${gpus##*:}
  [[ $gpus =~ ^[1-9][0-9]*$ ]] || gpus=$_dspark_tasks_per_node
  DSPARK_NPROC_PER_NODE=${_dspark_user_nproc:-$gpus}
  v=SLURM_CPUS_PER_TASK_HET_GROUP_$n
  _dspark_cpus_per_task=${!v:-1}
  OMP_NUM_THREADS=${_dspark_user_omp:-$_dspark_cpus_per_task}
  if [[ $DSPARK_LAUNCHER == torchrun ]]; then
    v=SLURM_JOB_CPUS_PER_NODE_HET_GROUP_$n  # "16", "16(x2)" or "16,8": the first node's
    on_node=${!v:-}
    _dspark_cpus_per_task=${on_node%%[(,]*}
    _dspark_cpus_per_task=${_dspark_cpus_per_task:-1}
    OMP_NUM_THREADS=${_dspark_user_omp:-$(( _dspark_cpus_per_task / DSPARK_NPROC_PER_NODE > 0 ? _dspark_cpus_per_task / DSPARK_NPROC_PER_NODE : 1 ))}
  fi
  export OMP_NUM_THREADS
  DSPARK_SRUN_ARGS="--het-group=$n $DSPARK_SRUN_ARGS"
  v=SLURM_JOB_ID_HET_GROUP_$n
  # NOTE: `scancel --signal` of the job signals every component's steps (the servers too); the
  # component's own job id reaches its steps only
  _dspark_signal_job=${!v:-$SLURM_JOB_ID}
}

# Servers beside the job step (vLLM, SGLang, `dspark-ds serve-target`): each a background srun
# step on one node, with its own GPUs and log; `dspark_serve_wait` until every one answers
# /health, `dspark_serve_stop` at the end.
_dspark_serve_pids=()
_dspark_serve_urls=()
_dspark_serve_logs=()

# dspark_serve_start [srun options] -- <node> <gpus> <first gpu> <url> <log> <command...>: one
# server on <node>, seeing GPUs <first gpu> .. <first gpu> + <gpus> - 1 of the node (none when
# <gpus> is 0), its output in <log>; <url> is where it will answer.
dspark_serve_start() {
  local opts=()
  while (($#)) && [[ $1 != -- ]]; do opts+=("$1"); shift; done
  shift
  local node=$1 gpus=$2 first=$3 url=$4 log=$5
  shift 5
  # NOTE: --overlap lets the servers share their component's allocation; the GPUs are chosen
  # inside the step, after Slurm has set the step's own CUDA_VISIBLE_DEVICES (all the node's).
  srun --nodes=1 --ntasks=1 --nodelist="$node" --overlap --kill-on-bad-exit=0 "${opts[@]}" \
    bash -c 'if (($1)); then export CUDA_VISIBLE_DEVICES=$(seq -s, "$2" $(($2 + $1 - 1))); fi; shift 2; exec "$@"' \
    _ "$gpus" "$first" "$@" </dev/null >"$log" 2>&1 &
  _dspark_serve_pids+=($!)
  _dspark_serve_urls+=("$url")
  _dspark_serve_logs+=("$log")
  local where="$node, no GPU"
  ((gpus == 0)) || where="$node, GPUs $first-$((first + gpus - 1))"
  _dspark_log "server ${#_dspark_serve_urls[@]} at $url ($where; log $log): $*"
}

# dspark_serve_wait: 0 once every server started answers /health; 1 and one line when one ended
# first, when DSPARK_SERVE_WAIT_S passed, or on a pre-emption warning or Slurm's TERM.
dspark_serve_wait() {
  local deadline=$((SECONDS + DSPARK_SERVE_WAIT_S)) i url rc last
  for i in "${!_dspark_serve_urls[@]}"; do
    url=${_dspark_serve_urls[$i]}
    # NOTE: no proxy: a site's http_proxy would not reach the job's nodes
    until "$PYTHON" -c 'import sys, urllib.request as u; u.build_opener(u.ProxyHandler({})).open(sys.argv[1], timeout=5)' \
        "${url%/v1}/health" 2>/dev/null; do
      if ! kill -0 "${_dspark_serve_pids[$i]}" 2>/dev/null; then
        rc=0
        wait "${_dspark_serve_pids[$i]}" 2>/dev/null || rc=$?
        last=$(grep -v '^[[:space:]]*$' "${_dspark_serve_logs[$i]}" 2>/dev/null | tail -n 1)
        _dspark_log "server $url ended (exit $rc) before answering /health; the end of ${_dspark_serve_logs[$i]}: ${last:-<empty>}"
        return 1
      fi
      if ((SECONDS >= deadline)); then
        _dspark_log "server $url did not answer /health within DSPARK_SERVE_WAIT_S=$DSPARK_SERVE_WAIT_S s (log ${_dspark_serve_logs[$i]})"
        return 1
      fi
      if ((_dspark_preempted || _dspark_stopped)); then
        _dspark_log "stopped while waiting for server $url to answer /health"
        return 1
      fi
      sleep 2
    done
  done
  _dspark_log "${#_dspark_serve_urls[@]} server(s) answer /health"
}

# dspark_serve_stop (once the job step has ended): TERM to the servers, their steps killed when
# they are still there 60 s later.
dspark_serve_stop() {
  ((${#_dspark_serve_pids[@]})) || return 0
  _dspark_log "stopping ${#_dspark_serve_pids[@]} server(s)"
  # NOTE: through Slurm, to the servers themselves: srun answers a TERM of its own by killing its
  # step outright (SIGKILL), which leaves a server no time to stop its workers
  scancel --signal=TERM "$SLURM_JOB_ID" 2>/dev/null || true
  local deadline=$((SECONDS + 60)) pid
  for pid in "${_dspark_serve_pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 1; done
    kill -TERM "$pid" 2>/dev/null || true
  done
  wait "${_dspark_serve_pids[@]}" 2>/dev/null || true
  _dspark_serve_pids=()
}
