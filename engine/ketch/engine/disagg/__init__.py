"""Prefill/decode disaggregation: the engine-to-engine protocol over --pd-comm-port."""
