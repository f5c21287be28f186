"""Autoscaling of an InferenceService's roles, in every mode the spec offers.

- ``metric_table``: the spec's metric types and the names they have on the way from the engine's
  ``/metrics`` to an autoscaler: HorizontalPodAutoscaler metrics, KEDA triggers, the
  prometheus-adapter rules (``mode: hpa`` and ``mode: keda``; the operator only renders these).
- ``settings``: the coordinated-autoscaling part of a spec (``mode: ketch``) as frozen values.
- ``decisions``: what the coordinated autoscaler decides each period (pure, no clock, no I/O).
- ``scrape``: reading the engine pods' ``/metrics`` for those decisions.
- ``loop``: the coordinated autoscaler's loop per InferenceService (scrape, decide, scale,
  status).
"""
