"""An InferenceService as the operator sees it: defaulted, validated, with the facts builders need.

The API server defaults and validates a spec against the CRD before the operator ever sees it;
the operator does it again, with the same schema and the same CEL rules, because ``render`` runs
without a server, a cluster may still have an older CRD installed, and some checks (the engine's
own ``__post_init__`` rules, and what this engine build refuses at start-up: ``runnable``) are
beyond the schema. A failure is an ``InvalidSpec`` naming every problem, never an exception that
makes kopf retry.

- ``parse``: ``parse()`` (an InferenceService object -> ``ServiceSpec`` or ``InvalidSpec``), the
  order the steps below run in.
- ``model``: ``ServiceSpec``, the validated, defaulted spec every builder takes.
- ``defaults``: the CRD schema's defaults, filled in as the API server does.
- ``admission``: the CRD's structural schema and CEL rules, checked as the API server does.
- ``checks``: the checks beyond the schema (``engine.extraArgs``, a draft model's path, the peer
  key) and the spec field an engine refusal names.
- ``engine_config``: a role's ``ketch serve`` config file, rendered from the spec.
- ``model_uri``: ``model.uri`` -> the path the engine loads and the name it serves.
"""
