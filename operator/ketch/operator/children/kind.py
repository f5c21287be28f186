"""What the reconciler knows of one child kind: a ``ChildKind`` record, one per module of
``children``, listed in ``children.KINDS``.

Everything that depends on the kind is here and nowhere else: where the API serves it, whether
kopf watches it, when it is applied, how it is built, and what is special about applying it (a
custom kind whose CRD may be missing; a Deployment whose ``replicas`` go to an autoscaler).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ketch.operator.spec.model import ServiceSpec

Obj = dict[str, Any]
# (the InferenceService, a pod role or None) -> its children of the kind
Build = Callable[[ServiceSpec, str | None], list[Obj]]


@dataclasses.dataclass(frozen=True)
class OptionalCRD:
    """A kind served by a CRD the cluster may lack. Its apply answered 404: everything else is
    applied, the kind is noted as not served (status says so) and a Warning Event names
    ``provider``; the next full reconcile tries again."""

    reason: str  # the Warning Event's reason
    provider: str  # what to install, as a question in that Event


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A child made ready to apply (``ChildKind.prepare``): the object to apply, and one to
    apply first, alone, under ``manager`` and not forced (409: skip it), or None."""

    child: Obj
    first: Obj | None = None
    manager: str = ""
    note: str = ""  # logged once ``first`` is applied


@dataclasses.dataclass(frozen=True)
class ChildKind:
    """One kind of child object an InferenceService owns.

    ``per_role``: ``build`` is called once per pod role (the engine roles, then ``router`` when
    the InferenceService has one), else once with None. ``stage``: children are applied stage
    by stage, each stage's concurrently (what a pod needs exists before the pod, a target before
    its autoscaler). ``watched``: kopf watches it (label-selected); unwatched kinds are looked up
    by name when pruned (``unwatched_names``: the names one may have, the spec being all that is
    known after a restart). ``keeps_answer``: the API's answer to an apply is kept and stands in
    for the object until the watch shows it (status reads it). ``prepare(svc, child, live)``:
    the child to apply, given the object as it is now (None: absent)."""

    kind: str
    api_version: str
    plural: str
    build: Build
    stage: int = 0
    per_role: bool = False
    watched: bool = True
    optional: OptionalCRD | None = None
    unwatched_names: Callable[[ServiceSpec], set[str]] | None = None
    keeps_answer: bool = False
    prepare: Callable[[ServiceSpec, Obj, Obj | None], Prepared] | None = None

    def __post_init__(self) -> None:
        if not self.watched and self.unwatched_names is None:
            raise ValueError(f"{self.kind}: an unwatched kind needs unwatched_names (pruning)")

    @property
    def group(self) -> str:
        return self.api_version.rpartition("/")[0]

    @property
    def version(self) -> str:
        return self.api_version.rpartition("/")[2]
