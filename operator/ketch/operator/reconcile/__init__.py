"""Reconciling an InferenceService's children (``children``) with the cluster.

- ``child``: ``reconcile_child``, one child the same way for every pass: its kind's hooks,
  server-side apply (or a create that is not forced), and the record of it (the cache's
  ``AppliedChild``, the apply metric, whether its kind is served).
- ``full``: a generation — build every child, check that the names are free, apply stage by
  stage, prune, one Event.
- ``drift``: a child that was deleted or edited by hand is put back.
- ``prune``: children no longer wanted are deleted.
- ``compare``: what counts as drift.
"""
