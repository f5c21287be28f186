"""Ownership: the operator writes and deletes only the children it created (security review M1).

A child is the operator's when its ``ownerReferences`` hold a controller reference to this
InferenceService's uid — the one ``objects.metadata`` puts on every child it applies. Anything
else of the same name (made by a person or another tool, or left by an earlier InferenceService
of that name whose garbage collection is still under way) is never applied to: a forced apply
would take its fields over, and the owner reference it adds would let the garbage collector
delete the object with the InferenceService. So:

- before a child is applied, what is known of it (the watch cache when that shows it as the
  operator's, else a GET) must be absent or the operator's; otherwise the child is a conflict
  (``ChildConflict``), reported in status (``Degraded/ChildConflict``) and retried with backoff;
- a child that does not exist is created by an apply that is not forced: if someone creates an
  object of that name between the GET and the apply, a field both set conflicts (409: nothing is
  written); where none does, the answer shows another manager's fields, and the operator takes
  its own fields off again (an empty apply of its manager) and reports the conflict;
- pruning deletes only children controlled by the InferenceService, with their uid as the
  delete's precondition (``prune``).
"""

from __future__ import annotations

import contextlib

from ketch.operator.cache import ChildKey, Obj
from ketch.operator.kube import ApiError, KubeClient
from ketch.operator.managers import FIELD_MANAGER

REASON = "ChildConflict"


class ChildConflict(Exception):
    """Children that exist under the names this InferenceService wants and are not its own."""

    def __init__(self, conflicts: dict[ChildKey, str]):
        self.conflicts = dict(conflicts)
        super().__init__(summary(self.conflicts))


def controller_ref(obj: Obj | None) -> Obj | None:
    for ref in ((obj or {}).get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref
    return None


def controlled_by(obj: Obj | None, uid: str) -> bool:
    """True when ``obj`` exists and its controller reference is the InferenceService ``uid``."""
    ref = controller_ref(obj)
    return bool(uid) and ref is not None and ref.get("uid") == uid


def holder(obj: Obj) -> str:
    """Who the object belongs to, as far as its metadata says (for people, not for decisions)."""
    meta = obj.get("metadata") or {}
    ref = controller_ref(obj)
    if ref is not None:
        return f"controlled by {ref.get('kind')} {ref.get('name')} (uid {ref.get('uid')})"
    owners = [f"{r.get('kind')} {r.get('name')}" for r in meta.get("ownerReferences") or []]
    if owners:
        return "owned by " + ", ".join(owners) + ", without a controller"
    managers = sorted(
        {str(e.get("manager")) for e in meta.get("managedFields") or [] if e.get("manager")}
    )
    if managers:
        return "no owner; written by " + ", ".join(managers)
    return "no owner"


def describe(kind: str, namespace: str, name: str, obj: Obj) -> str:
    return (
        f"{kind} {namespace}/{name} exists and is not controlled by this InferenceService "
        f"({holder(obj)}); the operator leaves it alone"
    )


def summary(conflicts: dict[ChildKey, str]) -> str:
    """One message for status and the Event: every conflict, and what to do."""
    return (
        "; ".join(conflicts[k] for k in sorted(conflicts))
        + ". Delete or rename the conflicting object, or rename the InferenceService."
    )


def foreign_managers(answer: Obj) -> list[str]:
    """The field managers other than the operator's apply in an apply's answer."""
    return sorted(
        {
            str(e.get("manager"))
            for e in (answer.get("metadata") or {}).get("managedFields") or []
            if (e.get("manager"), e.get("operation")) != (FIELD_MANAGER, "Apply")
        }
    )


async def create(client: KubeClient, uid: str, child: Obj) -> Obj:
    """Creates a child that a GET just found absent, with an apply that is not forced (see the
    module docstring); ``ChildConflict`` when an object of that name came first."""
    meta = child["metadata"]
    kind, namespace, name = child["kind"], meta["namespace"], meta["name"]
    try:
        answer = await client.apply(child, force=False)
    except ApiError as exc:
        # 409: a field someone else set; 422: e.g. a second controller reference.
        if exc.status not in (409, 422):
            raise
        existing = await client.get(kind, namespace, name)
        if existing is None:
            raise
        if controlled_by(existing, uid):  # made by this operator meanwhile (another replica)
            return await client.apply(child)
        raise ChildConflict({(kind, name): describe(kind, namespace, name, existing)}) from exc
    others = foreign_managers(answer)
    if not others:
        return answer
    # The object was made by someone else between the GET and the apply, and none of its fields
    # conflicted: take the operator's fields (its labels, its owner reference) off again.
    release = {
        "apiVersion": child["apiVersion"],
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace},
    }
    with contextlib.suppress(ApiError):  # the conflict is reported either way
        await client.apply(release, force=False)
    theirs = {"metadata": {"managedFields": [{"manager": m} for m in others]}}
    raise ChildConflict({(kind, name): describe(kind, namespace, name, theirs)})
