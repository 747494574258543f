#!/bin/sh
# Makes a test CA and the certificates of the README's secured example, as PEM files in DIR:
#   ca.pem                  the CA (clients and the proxy trust it)
#   proxy.pem, proxy.key    the proxy's certificate, for localhost and 127.0.0.1 (and $PROXY_HOST)
#   alice.pem, alice.key    client certificates, CN=alice and CN=bob
#   bob.pem, bob.key
# For trying things out only: use your own CA in production.
#   deploy/tls/make-certs.sh certs [PROXY_HOST]
set -eu
dir=${1:?usage: make-certs.sh DIR [PROXY_HOST]}
host=${2:-localhost}
mkdir -p "$dir"
cd "$dir"
openssl req -x509 -newkey rsa:2048 -nodes -days 365 -subj "/O=kafka-quota-proxy example/CN=example CA" \
  -keyout ca.key -out ca.pem 2>/dev/null
issue() {  # name, subject, subjectAltName (empty for a client)
  openssl req -newkey rsa:2048 -nodes -subj "$2" -keyout "$1.key" -out "$1.csr" 2>/dev/null
  if [ -n "$3" ]; then printf 'subjectAltName=%s\n' "$3" > "$1.ext"; else : > "$1.ext"; fi
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial -days 365 \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
  chmod 600 "$1.key"
}
issue proxy "/O=kafka-quota-proxy example/CN=$host" "DNS:$host,DNS:localhost,IP:127.0.0.1"
issue alice "/O=Acme/OU=payments/CN=alice" ""
issue bob "/O=Acme/OU=search/CN=bob" ""
rm -f ca.srl
chmod 600 ca.key
echo "certificates in $dir: ca.pem, proxy.pem/.key, alice.pem/.key, bob.pem/.key"
