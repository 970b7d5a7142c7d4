#!/usr/bin/env bash
# A private CA and the odb-pipeline service's TLS certificate, with openssl alone (docs/security.md).
#
#   bash deploy/tls/make-certs.sh OUT_DIR [NAMESPACE [SERVICE ...]]
#
# Writes into OUT_DIR (created, files mode 0600):
#   ca.crt   the CA certificate: what clients (trainers, `odb-pipeline status`) trust
#   ca.key   the CA's private key: keep it offline; it signs every future service certificate
#   tls.crt  the service certificate, signed by the CA, valid for the names clients dial: each
#            SERVICE (default: odb-pipeline and odb-pipeline-headless) bare, .NAMESPACE,
#            .NAMESPACE.svc and .NAMESPACE.svc.cluster.local, a StatefulSet's pods under it
#            (*.SERVICE...), and localhost / 127.0.0.1 (`odb-pipeline status` inside a replica)
#   tls.key  its private key (only the service mounts it)
#   .gitignore  `*`: git ignores the folder wherever it is made (a checkout included), so the
#            CA's key is never one `git add -A` away from a commit
# NAMESPACE defaults to odb. Then, on Kubernetes:
#   kubectl -n NAMESPACE create secret generic odb-pipeline-tls \
#     --from-file=OUT_DIR/tls.crt --from-file=OUT_DIR/tls.key --from-file=OUT_DIR/ca.crt
# Redis over TLS (k8s/overlays/prod-redis-tls): make-certs.sh OUT_DIR NAMESPACE odb-redis.
# On one machine: grpc.tls_cert / grpc.tls_key = tls.crt / tls.key, clients trust ca.crt.
set -euo pipefail

out="${1:?usage: make-certs.sh OUT_DIR [NAMESPACE [SERVICE ...]]}"
ns="${2:-odb}"
shift $(($# < 2 ? $# : 2))
services=("$@")
[ ${#services[@]} -gt 0 ] || services=(odb-pipeline odb-pipeline-headless)
umask 077
mkdir -p "$out"
printf '# made by deploy/tls/make-certs.sh: private keys, never committed\n*\n' > "$out/.gitignore"

sans="DNS:localhost,IP:127.0.0.1"
for svc in "${services[@]}"; do
  for suffix in "" ".$ns" ".$ns.svc" ".$ns.svc.cluster.local"; do
    sans="$sans,DNS:$svc$suffix,DNS:*.$svc$suffix"
  done
done

# The CA: a self-signed P-256 certificate that may only sign certificates.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 3650 \
  -subj "/CN=odb-pipeline CA" -keyout "$out/ca.key" -out "$out/ca.crt" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign"
# The service's key and certificate request, then the CA's signature with the names above.
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -subj "/CN=${services[0]}" -keyout "$out/tls.key" -out "$out/tls.csr"
printf 'subjectAltName=%s\nbasicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n' \
  "$sans" > "$out/tls.ext"
openssl x509 -req -in "$out/tls.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
  -CAcreateserial -days 397 -extfile "$out/tls.ext" -out "$out/tls.crt"
rm -f "$out/tls.csr" "$out/tls.ext" "$out/ca.srl"
echo "make-certs: $out/ca.crt, ca.key (keep offline), tls.crt, tls.key for ${services[*]} in" \
  "namespace $ns"
