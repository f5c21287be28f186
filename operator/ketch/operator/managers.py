"""The operator's field managers: the names its server-side applies and scale updates carry,
which the API server records in each object's ``managedFields``."""

FIELD_MANAGER = "ketch-operator"
AUTOSCALER_FIELD_MANAGER = "ketch-autoscaler"  # the coordinated autoscaler's replica changes
HANDOFF_FIELD_MANAGER = "ketch-operator-handoff"  # holds replicas on the way to an autoscaler
