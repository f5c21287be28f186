"""Ketch Kubernetes operator (InferenceService reconciler)."""
