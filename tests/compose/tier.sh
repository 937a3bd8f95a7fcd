#!/usr/bin/env bash
# `make test-compose`: deploy/Dockerfile and deploy/docker-compose.yml built and run for real,
# without a container registry (docs/containers.md, "Offline"):
# 1. Debian's podman, runc, mmdebstrap, netavark, aardvark-dns and iptables, and podman-compose
#    from PyPI in .venv-compose (each only when missing);
# 2. the base images (deploy/offline-images.sh): python:3.11-slim and redis:7-alpine stand-ins
#    from Debian packages; deploy/.env with random secrets (deploy/make-env.sh);
# 3. the project's image from deploy/Dockerfile as it is (kvbaton:latest);
# 4. pytest tests/compose: the stacks up and used from the host, then down.
# Whatever happens, it leaves no container, network or volume of its project, nor the images it
# built or imported (the root filesystem stays cached in ~/.cache/kvbaton for the next run).
set -euo pipefail
cd "$(dirname "$0")/../.."

PROJECT=kvbaton-test
VENV=.venv-compose
PODMAN_COMPOSE_VERSION=1.6.0
LOG=.compose-test.log
BIN=${VENV_BIN:-.venv/bin} # the project's venv (make install)
export CONTAINERS_CONF=$PWD/deploy/podman/containers.conf
export BUILDAH_FORMAT=docker # keeps the Dockerfile's HEALTHCHECK (OCI images have none)
export DEBIAN_FRONTEND=noninteractive
IMAGE=$("$BIN/python" -c "import yaml; print(yaml.safe_load(open('deploy/docker-compose.yml'))['x-kvbaton-image']['image'])")

now() { echo "$SECONDS"; }
since() { echo $((SECONDS - $1)); }
: >"$LOG"

t=$(now)
missing=()
for tool in podman:podman runc:runc mmdebstrap:mmdebstrap iptables:iptables \
  /usr/lib/podman/netavark:netavark /usr/lib/podman/aardvark-dns:aardvark-dns; do
  command -v "${tool%%:*}" >/dev/null || missing+=("${tool##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "test-compose: installing ${missing[*]} (Debian packages)"
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >>"$LOG" 2>&1 \
    || { tail -20 "$LOG" >&2; echo "test-compose: apt-get install failed" >&2; exit 1; }
fi
if [ "$("$VENV/bin/podman-compose" --version 2>/dev/null | head -1)" != "podman-compose version $PODMAN_COMPOSE_VERSION" ]; then
  echo "test-compose: installing podman-compose $PODMAN_COMPOSE_VERSION into $VENV"
  rm -rf "$VENV"
  { python3 -m venv "$VENV" && "$VENV/bin/pip" install -q "podman-compose==$PODMAN_COMPOSE_VERSION"; } >>"$LOG" 2>&1 \
    || { tail -20 "$LOG" >&2; echo "test-compose: installing podman-compose failed" >&2; exit 1; }
fi
echo "test-compose: tools ready in $(since "$t") s ($(podman --version), podman-compose $PODMAN_COMPOSE_VERSION)"

# The compose file fixes its network's subnet (the GPU profile's engines have fixed addresses):
# a stack of another project still up would make ours fail half way.
SUBNET=$("$BIN/python" -c "import yaml; print(yaml.safe_load(open('deploy/docker-compose.yml'))['networks']['default']['ipam']['config'][0]['subnet'])")
for net in $(podman network ls -q); do
  if [ "$net" != "${PROJECT}_default" ] \
    && podman network inspect --format '{{range .Subnets}}{{.Subnet}} {{end}}' "$net" | grep -qw "$SUBNET"; then
    echo "test-compose: the podman network $net already uses $SUBNET, the compose file's subnet: take its stack down first" >&2
    exit 1
  fi
done
# A network removed by a podman without this CONTAINERS_CONF leaves aardvark-dns answering
# for its containers: the same service names would resolve to gone addresses.
for f in /run/containers/networks/aardvark-dns/*; do
  [ -f "$f" ] && [ "${f##*/}" != aardvark.pid ] || continue
  if ! podman network exists "${f##*/}"; then
    echo "test-compose: $f names a network podman does not have (removed without CONTAINERS_CONF?): delete the file" >&2
    exit 1
  fi
done

PYTEST_PID=
teardown() {
  local rc=$?
  set +e
  trap - EXIT INT TERM
  if [ -n "$PYTEST_PID" ]; then # stopped half way: pytest and the podman commands it runs
    kill -TERM -- "-$PYTEST_PID" 2>/dev/null
    sleep 1
    kill -KILL -- "-$PYTEST_PID" 2>/dev/null
  fi
  "$VENV/bin/podman-compose" -p "$PROJECT" -f deploy/docker-compose.yml \
    --profile push --profile store down -t 10 >>"$LOG" 2>&1
  # what compose down did not reach (a run killed half way, the tests' own containers)
  podman ps -aq --filter "label=com.docker.compose.project=$PROJECT" | xargs -r podman rm -f >>"$LOG" 2>&1
  podman ps -aq --filter "name=^$PROJECT-" | xargs -r podman rm -f >>"$LOG" 2>&1
  podman network ls -q --filter "label=com.docker.compose.project=$PROJECT" | xargs -r podman network rm -f >>"$LOG" 2>&1
  podman volume ls -q --filter "label=com.docker.compose.project=$PROJECT" | xargs -r podman volume rm -f >>"$LOG" 2>&1
  podman rmi -f "$IMAGE" >>"$LOG" 2>&1
  deploy/offline-images.sh --remove >>"$LOG" 2>&1
  left=$(podman ps -aq --filter "label=com.docker.compose.project=$PROJECT")
  [ -z "$left" ] || { echo "test-compose: containers left: $left" >&2; rc=1; }
  echo "test-compose: torn down; $(podman ps -aq | wc -l) containers, $(podman images -q | wc -l) images left in podman"
  exit "$rc"
}
trap teardown EXIT
trap 'exit 130' INT TERM

t=$(now)
deploy/offline-images.sh
deploy/make-env.sh
echo "test-compose: base images in $(since "$t") s"

t=$(now)
# --layers=false: no intermediate image of the build stage is kept (nothing to clean up).
podman build -q --layers=false -f deploy/Dockerfile -t "$IMAGE" . >>"$LOG" 2>&1 \
  || { tail -30 "$LOG" >&2; echo "test-compose: building deploy/Dockerfile failed" >&2; exit 1; }
echo "test-compose: built $IMAGE from deploy/Dockerfile in $(since "$t") s ($(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{printf "%d MB", $1/1e6}'))"

t=$(now)
rc=0
# In the background and its own process group, so that a signal to this script runs the
# teardown at once, after stopping pytest and whatever podman command it is running.
KVBATON_TEST_COMPOSE=1 KVBATON_PODMAN_COMPOSE="$PWD/$VENV/bin/podman-compose" \
  setsid "$BIN/pytest" tests/compose -p no:cacheprovider --durations=5 "$@" &
PYTEST_PID=$!
wait "$PYTEST_PID" || rc=$?
PYTEST_PID=
echo "test-compose: tests took $(since "$t") s"
exit $rc
