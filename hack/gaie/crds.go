// Package gaie only pins, through go.mod, the Gateway API and Gateway API Inference Extension
// modules whose CRD manifests hack/build-control-plane.sh copies into the binary cache (the
// tests install them into the real control plane). Nothing here is built.
package gaie

import (
	_ "sigs.k8s.io/gateway-api-inference-extension/api/v1"
	_ "sigs.k8s.io/gateway-api/apis/v1"
)
