#!/usr/bin/env bash
# Renders every overlay of deploy/kubernetes with kustomize and validates
# each object with kubeconform against the schemas of Kubernetes
# $K8S_VERSION and of cert-manager $CERT_MANAGER_VERSION, strictly (an
# unknown field fails). Needs only Go: the tools are `go install`ed into
# build/tools, the OpenAPI documents come from those projects' Go modules
# (k8s.io/kubernetes api/openapi-spec, cert-manager's deploy/crds), and
# deploy/k8sschema turns them into kubeconform's JSON schemas. CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

K8S_VERSION=v1.35.4
CERT_MANAGER_VERSION=v1.21.2
KUBECONFORM_VERSION=v0.8.0
KUSTOMIZE_VERSION=v5.8.2 # v5.8.3 wants Go 1.27

out=build/validate
tools=build/tools
mkdir -p "$out" "$tools"
tools=$(cd "$tools" && pwd)

install() { # name version package
  if [ ! -x "$tools/$1-$2" ]; then
    echo "== go install $3@$2"
    GOBIN="$tools" go install "$3@$2"
    mv "$tools/$1" "$tools/$1-$2"
  fi
}
install kubeconform "$KUBECONFORM_VERSION" github.com/yannh/kubeconform/cmd/kubeconform
install kustomize "$KUSTOMIZE_VERSION" sigs.k8s.io/kustomize/kustomize/v5

moddir() { # module@version → its directory in the module cache
  (cd "$(mktemp -d)" && go mod download -json "$1" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
}
schemas="$out/schemas-$K8S_VERSION-cert-manager-$CERT_MANAGER_VERSION"
if [ ! -d "$schemas" ]; then
  k8s=$(moddir "k8s.io/kubernetes@$K8S_VERSION")
  cm=$(moddir "github.com/cert-manager/cert-manager@$CERT_MANAGER_VERSION")
  go run ./deploy/k8sschema -out "$schemas.tmp" -swagger "$k8s/api/openapi-spec/swagger.json" \
    -crd "$cm/deploy/crds/cert-manager.io_certificates.yaml" -crd "$cm/deploy/crds/cert-manager.io_issuers.yaml"
  mv "$schemas.tmp" "$schemas"
fi

status=0
for overlay in deploy/kubernetes/overlays/*/; do
  name=$(basename "$overlay")
  echo "== $overlay"
  "$tools/kustomize-$KUSTOMIZE_VERSION" build "$overlay" > "$out/$name.yaml"
  "$tools/kubeconform-$KUBECONFORM_VERSION" -strict -summary -output text \
    -schema-location "$PWD/$schemas/{{ .Group }}/{{ .ResourceKind }}_{{ .ResourceAPIVersion }}.json" \
    "$out/$name.yaml" || status=1
done
exit $status
