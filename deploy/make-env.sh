#!/usr/bin/env bash
# deploy/.env for the compose stacks: a random KVBATON_SESSION_SECRET (the routers sign each
# session's handle and digests with it) and KVBATON_ADMIN_KEY (the admin API's bearer key).
# Compose reads deploy/.env by itself. An existing file is kept (its secrets too); a missing
# variable is added. The file is git-ignored: never commit it.
set -euo pipefail
ENV_FILE=${1:-$(dirname "$0")/.env}
random() { od -An -tx1 -N32 /dev/urandom | tr -d ' \n'; }
touch "$ENV_FILE"
chmod 600 "$ENV_FILE"
for name in KVBATON_SESSION_SECRET KVBATON_ADMIN_KEY; do
  if ! grep -q "^$name=." "$ENV_FILE"; then
    sed -i "/^$name=/d" "$ENV_FILE"
    echo "$name=$(random)" >>"$ENV_FILE"
    echo "make-env: wrote $name to $ENV_FILE"
  fi
done
