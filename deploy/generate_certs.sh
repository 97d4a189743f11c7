#!/usr/bin/env bash
# Generate a private CA and a SuperLink TLS certificate signed by it.
#
#   deploy/generate_certs.sh OUT_DIR HOST [HOST ...]
#
# Each HOST (a DNS name or an IPv4/IPv6 address) goes into the certificate's
# subjectAltName: list every name the SuperNodes and `flwr` use to reach the
# SuperLink. Writes OUT_DIR/ca.crt (give it to every SuperNode and to `flwr`),
# OUT_DIR/ca.key (keep it offline), OUT_DIR/server.pem and OUT_DIR/server.key
# (the SuperLink's). Existing files are left alone unless FORCE=1.
set -euo pipefail

if [ "$#" -lt 2 ]; then
  echo "usage: $0 OUT_DIR HOST [HOST ...]   (HOST: DNS name or IP the SuperLink is reached by)" >&2
  exit 2
fi
out="$1"; shift
command -v openssl >/dev/null || { echo "$0: openssl is required" >&2; exit 1; }
if [ -e "$out/server.pem" ] && [ "${FORCE:-0}" != "1" ]; then
  echo "$0: $out/server.pem exists; set FORCE=1 to replace it" >&2
  exit 1
fi
mkdir -p "$out"
days="${DAYS:-365}"

sans=""
for host in "$@"; do
  if [[ "$host" =~ ^[0-9.]+$ || "$host" == *:* ]]; then
    sans="$sans,IP:$host"
  else
    sans="$sans,DNS:$host"
  fi
done
sans="${sans#,}"

openssl genrsa -out "$out/ca.key" 2048 2>/dev/null
openssl req -new -x509 -sha256 -days "$days" -key "$out/ca.key" \
  -subj "/O=FedMITR/CN=FedMITR deployment CA" -out "$out/ca.crt"
openssl genrsa -out "$out/server.key" 2048 2>/dev/null
openssl req -new -sha256 -key "$out/server.key" -subj "/O=FedMITR/CN=$1" \
  -out "$out/server.csr"
printf 'subjectAltName=%s\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n' \
  "$sans" > "$out/server.ext"
openssl x509 -req -sha256 -days "$days" -in "$out/server.csr" -CA "$out/ca.crt" \
  -CAkey "$out/ca.key" -CAcreateserial -extfile "$out/server.ext" -out "$out/server.pem" 2>/dev/null
rm -f "$out/server.csr" "$out/server.ext" "$out/ca.srl"
chmod 600 "$out/ca.key" "$out/server.key"
echo "wrote $out/ca.crt, $out/server.pem, $out/server.key (SANs: $sans)"
