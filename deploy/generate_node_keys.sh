#!/usr/bin/env bash
# Generate one ECDSA P-384 key pair per SuperNode for node authentication.
#
#   deploy/generate_node_keys.sh OUT_DIR NAME [NAME ...]
#
# Writes OUT_DIR/NAME (private key: stays on that SuperNode's machine, passed as
# --auth-supernode-private-key) and OUT_DIR/NAME.pub (public key: registered on
# the SuperLink with `flwr supernode register OUT_DIR/NAME.pub <federation>`).
set -euo pipefail

if [ "$#" -lt 2 ]; then
  echo "usage: $0 OUT_DIR NAME [NAME ...]" >&2
  exit 2
fi
out="$1"; shift
command -v ssh-keygen >/dev/null || { echo "$0: ssh-keygen (OpenSSH) is required" >&2; exit 1; }
mkdir -p "$out"
for name in "$@"; do
  if [ -e "$out/$name" ]; then
    echo "$0: $out/$name exists, kept" >&2
    continue
  fi
  ssh-keygen -q -t ecdsa -b 384 -N "" -C "fedmitr-$name" -f "$out/$name"
  echo "wrote $out/$name and $out/$name.pub"
done
