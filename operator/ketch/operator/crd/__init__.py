"""The InferenceService CRD, generated from Python: one definition for the schema and the flags.

The ``spec.engine``, ``spec.ports`` and ``spec.model.name`` fields are not written here: they are
generated from ``EngineConfig`` and ``ServerConfig`` (``ketch.engine``), whose field metadata also
generates ``ketch serve``'s flags. A CRD field and the flag it sets therefore share their name,
type, default, bounds and description (the table is ``engine_fields``, which also walks the
metadata the other way, turning a spec back into the engine's config file).

- ``document``: the whole CustomResourceDefinition (``crd_document()``).
- ``spec``: ``spec`` (roles, router, auth) and the rules that tie its parts together.
- ``engine``: what runs in an engine pod (``spec.engine``, ``ports``, ``model``,
  ``cacheManager``); ``engine_fields``: the table of engine settings it is generated from.
- ``autoscaling``, ``gateway``: ``spec.roles.<role>.autoscaling`` and ``spec.autoscaling``;
  ``spec.gateway``.
- ``status``: ``status``.
- ``schema``: the building blocks (typed properties, CEL rules, bounds).

``crds/`` holds the output of ``ketch-operator crd``; a test fails when it is stale.
"""
