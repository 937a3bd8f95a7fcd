#!/usr/bin/env bash
# The two images deploy/Dockerfile and docker-compose.yml start FROM, built without a registry:
#   python:3.11-slim   Debian bookworm (minbase) with python3 3.11, venv, pip and ca-certificates,
#                      a venv at /opt/python first on PATH (python, pip, console scripts, as in
#                      the official image); the host's local CA certificates are added, so pip
#                      inside a build trusts what the host trusts (a TLS-inspecting proxy)
#   redis:7-alpine     the same base with Debian's redis-server (7.0) and redis-cli
# Both carry the label io.kvbaton.offline=<recipe hash>. An image of either name that is
# already there (a real one from a registry, or ours of this recipe) is kept as it is.
#
# Needs: mmdebstrap, and podman (CONTAINER_ENGINE=docker works too). The root filesystem is
# cached in $KVBATON_OFFLINE_CACHE (default ~/.cache/kvbaton/offline-images), so a second
# import takes seconds. Usage: deploy/offline-images.sh [--remove]  (--remove: delete the
# images this script made, and nothing else).
set -euo pipefail

ENGINE=${CONTAINER_ENGINE:-podman}
CACHE=${KVBATON_OFFLINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvbaton/offline-images}
SUITE=bookworm # its python3 is 3.11, the version python:3.11-slim names
PACKAGES=python3,python3-venv,python3-pip,ca-certificates
BASE=docker.io/library/python:3.11-slim
REDIS=docker.io/library/redis:7-alpine
LABEL=io.kvbaton.offline
PATH_ENV=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
LOCAL_CA=/usr/local/share/ca-certificates
RECIPE="$SUITE minbase $PACKAGES venv:/opt/python redis-server $(cat "$LOCAL_CA"/*.crt 2>/dev/null | sha256sum)"
HASH=$(echo "$RECIPE" | sha256sum | cut -c1-12)

ours() { [ "$("$ENGINE" image inspect --format "{{index .Config.Labels \"$LABEL\"}}" "$1" 2>/dev/null)" != "" ]; }
present() { "$ENGINE" image inspect "$1" >/dev/null 2>&1; }

if [ "${1:-}" = "--remove" ]; then
  for image in "$REDIS" "$BASE"; do
    if ours "$image"; then "$ENGINE" rmi -f "$image" >/dev/null; fi
  done
  exit 0
fi

rootfs() {
  local tar=$CACHE/$SUITE-python-$HASH.tar
  if [ ! -f "$tar" ]; then
    mkdir -p "$CACHE"
    rm -f "$CACHE"/*.tar.part
    # Debian's own docs, man pages and translations are not needed in an image.
    mmdebstrap --quiet --variant=minbase --include="$PACKAGES" \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' \
      --customize-hook="if ls $LOCAL_CA/*.crt >/dev/null 2>&1; then cp $LOCAL_CA/*.crt \"\$1$LOCAL_CA/\"; fi" \
      --customize-hook='chroot "$1" update-ca-certificates >/dev/null 2>&1' \
      --customize-hook='chroot "$1" python3 -m venv /opt/python' \
      --format=tar "$SUITE" "$tar.part" >&2
    mv "$tar.part" "$tar"
  fi
  echo "$tar"
}

if present "$BASE" && ! ours "$BASE"; then
  echo "offline-images: $BASE is already there (not ours): kept"
elif ours "$BASE" && [ "$("$ENGINE" image inspect --format "{{index .Config.Labels \"$LABEL\"}}" "$BASE")" = "$HASH" ]; then
  echo "offline-images: $BASE is up to date"
else
  tar=$(rootfs)
  "$ENGINE" import -q --change "ENV PATH=$PATH_ENV" --change "LABEL $LABEL=$HASH" \
    --change 'CMD ["python3"]' "$tar" "$BASE" >/dev/null
  echo "offline-images: imported $BASE from $tar"
fi

if present "$REDIS" && ! ours "$REDIS"; then
  echo "offline-images: $REDIS is already there (not ours): kept"
elif ours "$REDIS" && [ "$("$ENGINE" image inspect --format "{{index .Config.Labels \"$LABEL\"}}" "$REDIS")" = "$HASH" ]; then
  echo "offline-images: $REDIS is up to date"
else
  # No build context: the Containerfile comes on standard input.
  "$ENGINE" build -q -t "$REDIS" --label "$LABEL=$HASH" - >/dev/null <<EOF
FROM $BASE
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends redis-server \\
    >/dev/null 2>&1 && apt-get clean && rm -rf /var/lib/apt/lists/*
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
EOF
  echo "offline-images: built $REDIS (Debian's redis-server)"
fi
