#!/usr/bin/env bash
# Builds the control plane the tests and `make cluster-up` run, from Go modules:
#   kube-apiserver, kube-controller-manager, kube-scheduler, kubectl  (wrapper module hack/k8s)
#   etcd                                                     (wrapper module hack/etcd)
#   prometheus, prometheus-adapter (metrics for real HPAs)   (hack/prometheus, hack/prometheus-adapter)
#   kwok (fake nodes: bursts of pods, bench_operator.py)     (hack/kwok)
#   helm (the chart's lint, template, install and upgrade tests) (hack/helm)
#   gaie: no binary; the Gateway API and Gateway API Inference Extension CRD manifests
#         (HTTPRoute, Gateway, InferencePool...) copied from their modules  (hack/gaie)
#   lwepp: GAIE's lightweight reference endpoint picker (round robin over an InferencePool;
#         tests/operator/test_lwepp.py)                     (hack/lwepp)
# Binaries go to $KETCH_BIN_CACHE/<component>/<version>/bin (default ~/.cache/ketch), never into
# the repository; a version already built is not rebuilt. Prints one line per component:
#   <component> <version> <bin dir> (built in Ns | cached)
# Usage: hack/build-control-plane.sh [k8s|etcd|prometheus|prometheus-adapter|metrics|kwok|helm|gaie|lwepp|test|all]
#   test (the default): what the test suite and `make cluster-up` need, all but kwok;
#   all: also kwok (only benchmarks/bench_operator.py uses it)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${KETCH_BIN_CACHE:-$HOME/.cache/ketch}"

command -v go >/dev/null 2>&1 || { echo "go not found: Go 1.26 is needed to build the control plane" >&2; exit 1; }

# The versions are the wrapper modules' own: one place to change them.
mod_version() { # module-dir module-path
  (cd "$here/$1" && go list -m -f '{{.Version}}' "$2")
}

build_k8s() {
  local v bin start
  v="$(mod_version k8s k8s.io/kubernetes)"
  bin="$cache/k8s/$v/bin"
  if [ -x "$bin/kube-apiserver" ] && [ -x "$bin/kube-controller-manager" ] && [ -x "$bin/kube-scheduler" ] && [ -x "$bin/kubectl" ]; then
    echo "k8s $v $bin (cached)"; return
  fi
  start=$SECONDS
  mkdir -p "$bin.tmp"
  # Without the -X flags /version says v0.0.0-master; the ldflags are what upstream's
  # hack/lib/version.sh sets for a release build.
  (cd "$here/k8s" && CGO_ENABLED=0 go build -trimpath \
    -ldflags "-s -w -X k8s.io/component-base/version.gitVersion=$v -X k8s.io/client-go/pkg/version.gitVersion=$v -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(echo "$v" | cut -d. -f2) -X k8s.io/component-base/version.gitTreeState=clean" \
    -o "$bin.tmp/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubectl)
  rm -rf "$bin"; mv "$bin.tmp" "$bin"
  echo "k8s $v $bin (built in $((SECONDS - start))s)"
}

build_etcd() {
  local v bin start
  v="$(mod_version etcd go.etcd.io/etcd/server/v3)"
  bin="$cache/etcd/$v/bin"
  if [ -x "$bin/etcd" ]; then echo "etcd $v $bin (cached)"; return; fi
  start=$SECONDS
  mkdir -p "$bin.tmp"
  (cd "$here/etcd" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$bin.tmp/etcd" go.etcd.io/etcd/server/v3)
  rm -rf "$bin"; mv "$bin.tmp" "$bin"
  echo "etcd $v $bin (built in $((SECONDS - start))s)"
}

# prometheus-adapter (wrapper module hack/prometheus-adapter): the custom metrics API the HPA
# controller reads engine metrics from (hack/localcluster/metrics.py deploys it as a pod). The
# binary is named as in the upstream image (/adapter); no version ldflags: upstream sets none.
build_prometheus_adapter() {
  local v bin start
  v="$(mod_version prometheus-adapter sigs.k8s.io/prometheus-adapter)"
  bin="$cache/prometheus-adapter/$v/bin"
  if [ -x "$bin/adapter" ]; then echo "prometheus-adapter $v $bin (cached)"; return; fi
  start=$SECONDS
  mkdir -p "$bin.tmp"
  (cd "$here/prometheus-adapter" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" \
    -o "$bin.tmp/adapter" sigs.k8s.io/prometheus-adapter/cmd/adapter)
  rm -rf "$bin"; mv "$bin.tmp" "$bin"
  echo "prometheus-adapter $v $bin (built in $((SECONDS - start))s)"
}

# Prometheus (wrapper module hack/prometheus), for the monitoring stack of metrics.py. Debian's
# package cannot serve: it is built without Kubernetes service discovery. Only that discovery
# is compiled in (upstream's plugin build tags); no web UI assets (the API and /-/ready do not
# need them). Module v0.3XX.Y is Prometheus v3.XX.Y: the version the cache and --version use.
build_prometheus() {
  local mv v bin start minor
  mv="$(mod_version prometheus github.com/prometheus/prometheus)"
  minor="${mv#v0.3}"; v="v3.$((10#${minor%%.*})).${minor#*.}"
  bin="$cache/prometheus/$v/bin"
  if [ -x "$bin/prometheus" ]; then echo "prometheus $v $bin (cached)"; return; fi
  start=$SECONDS
  mkdir -p "$bin.tmp"
  (cd "$here/prometheus" && CGO_ENABLED=0 go build -trimpath -tags remove_all_sd,enable_kubernetes_sd \
    -ldflags "-s -w -X github.com/prometheus/common/version.Version=${v#v} -X github.com/prometheus/common/version.Branch=HEAD" \
    -o "$bin.tmp/prometheus" github.com/prometheus/prometheus/cmd/prometheus)
  rm -rf "$bin"; mv "$bin.tmp" "$bin"
  echo "prometheus $v $bin (built in $((SECONDS - start))s)"
}

# KWOK's controller (wrapper module hack/kwok): fake Nodes whose pods it marks Running/Ready
# without running anything, for bursts of hundreds of pods (tests/kwok.py starts it;
# benchmarks/bench_operator.py). Built only when asked (`kwok`) or with `all`. The version is in
# its source already (pkg/consts.Version, what upstream's release -X sets): no version ldflags.
# The controller has no built-in stages (it exits "no stages found"); kwokctl writes upstream's
# default ones into its config, and so do we: they are copied from the module beside the binary,
# to $cache/kwok/<version>/stages.
kwok_stages="node/fast/node-initialize node/heartbeat-with-lease/node-heartbeat-with-lease pod/fast/pod-ready pod/fast/pod-complete pod/fast/pod-delete"
build_kwok() {
  local v bin start dir s
  v="$(mod_version kwok sigs.k8s.io/kwok)"
  bin="$cache/kwok/$v/bin"
  if [ -x "$bin/kwok" ] && [ -d "$cache/kwok/$v/stages" ]; then echo "kwok $v $bin (cached)"; return; fi
  start=$SECONDS
  mkdir -p "$bin.tmp" "$cache/kwok/$v/stages.tmp"
  (cd "$here/kwok" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$bin.tmp/kwok" sigs.k8s.io/kwok/cmd/kwok)
  dir="$(cd "$here/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)"
  for s in $kwok_stages; do
    install -m 0644 "$dir/kustomize/stage/$s.yaml" "$cache/kwok/$v/stages.tmp/"
  done
  rm -rf "$bin" "$cache/kwok/$v/stages"; mv "$bin.tmp" "$bin"; mv "$cache/kwok/$v/stages.tmp" "$cache/kwok/$v/stages"
  echo "kwok $v $bin (built in $((SECONDS - start))s)"
}

# Helm v4 (wrapper module hack/helm): the CLI the chart tests run (lint, template, install,
# upgrade). The version ldflag is what upstream's Makefile sets for a release build.
build_helm() {
  local v bin start
  v="$(mod_version helm helm.sh/helm/v4)"
  bin="$cache/helm/$v/bin"
  if [ -x "$bin/helm" ]; then echo "helm $v $bin (cached)"; return; fi
  start=$SECONDS
  mkdir -p "$bin.tmp"
  (cd "$here/helm" && CGO_ENABLED=0 go build -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$v -X helm.sh/helm/v4/internal/version.gitTreeState=clean" \
    -o "$bin.tmp/helm" helm.sh/helm/v4/cmd/helm)
  rm -rf "$bin"; mv "$bin.tmp" "$bin"
  echo "helm $v $bin (built in $((SECONDS - start))s)"
}

# The CRDs of the Gateway API (standard channel) and of the Gateway API Inference Extension, as
# their modules ship them (config/crd/...), to $cache/gaie/<gaie version>/crds. Nothing is built:
# the wrapper module hack/gaie pins both versions.
gaie_crds="gateway.networking.k8s.io_gatewayclasses gateway.networking.k8s.io_gateways gateway.networking.k8s.io_httproutes gateway.networking.k8s.io_referencegrants"
build_gaie() {
  local v dir gw out c
  v="$(mod_version gaie sigs.k8s.io/gateway-api-inference-extension)"
  out="$cache/gaie/$v/crds"
  if [ -f "$out/inference.networking.k8s.io_inferencepools.yaml" ]; then echo "gaie $v $out (cached)"; return; fi
  (cd "$here/gaie" && go mod download sigs.k8s.io/gateway-api-inference-extension sigs.k8s.io/gateway-api)
  dir="$(cd "$here/gaie" && go list -m -f '{{.Dir}}' sigs.k8s.io/gateway-api-inference-extension)"
  gw="$(cd "$here/gaie" && go list -m -f '{{.Dir}}' sigs.k8s.io/gateway-api)"
  mkdir -p "$out.tmp"
  install -m 0644 "$dir"/config/crd/bases/*.yaml "$out.tmp/"
  for c in $gaie_crds; do install -m 0644 "$gw/config/crd/standard/$c.yaml" "$out.tmp/"; done
  rm -rf "$out"; mv "$out.tmp" "$out"
  echo "gaie $v $out (copied)"
}

# GAIE's lightweight endpoint picker (wrapper module hack/lwepp), a third-party ext_proc picker
# for Ketch pods (tests/operator/test_lwepp.py). Part of `test` (about 5 minutes on 2 cores).
build_lwepp() {
  local v bin start
  v="$(mod_version lwepp sigs.k8s.io/gateway-api-inference-extension)"
  bin="$cache/lwepp/$v/bin"
  if [ -x "$bin/lwepp" ]; then echo "lwepp $v $bin (cached)"; return; fi
  start=$SECONDS
  mkdir -p "$bin.tmp"
  (cd "$here/lwepp" && CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" \
    -o "$bin.tmp/lwepp" sigs.k8s.io/gateway-api-inference-extension/cmd/lwepp)
  rm -rf "$bin"; mv "$bin.tmp" "$bin"
  echo "lwepp $v $bin (built in $((SECONDS - start))s)"
}

case "${1:-test}" in
  --bin-path)
    echo "$cache/k8s/$(mod_version k8s k8s.io/kubernetes)/bin:$cache/etcd/$(mod_version etcd go.etcd.io/etcd/server/v3)/bin"
    exit 0 ;;
  k8s) build_k8s ;;
  etcd) build_etcd ;;
  prometheus-adapter) build_prometheus_adapter ;;
  prometheus) build_prometheus ;;
  metrics) build_prometheus; build_prometheus_adapter ;;
  kwok) build_kwok ;;
  helm) build_helm ;;
  gaie) build_gaie ;;
  lwepp) build_lwepp ;;
  test) build_etcd; build_k8s; build_prometheus; build_prometheus_adapter; build_helm; build_gaie; build_lwepp ;;
  all) build_etcd; build_k8s; build_prometheus; build_prometheus_adapter; build_helm; build_gaie; build_kwok; build_lwepp ;;
  *) echo "usage: $0 [k8s|etcd|prometheus|prometheus-adapter|metrics|kwok|helm|gaie|lwepp|test|all]" >&2; exit 2 ;;
esac
