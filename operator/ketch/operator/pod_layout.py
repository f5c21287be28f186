"""Where things are inside an engine pod: the config directory, the model mount, the key files,
the names of the volumes and containers other parts look for, and what the model-fetch init
container reads.

A leaf: the config file the operator renders (``spec.engine_config``) names these paths, the
containers (``containers``) mount them, and status (``status``) names the model-fetch container.
"""

from __future__ import annotations

CONFIG_DIR = "/etc/ketch"  # the role's config file: <CONFIG_DIR>/<role>.yaml
MODEL_MOUNT = "/models"
API_KEY_PATH = "/var/run/secrets/ketch/api-key"
PEER_KEY_PATH = "/var/run/secrets/ketch-peer/peer-key"
PEER_KEY_VOLUME = "peer-key"
# The init container that fetches hf:// and s3:// weights; status names it when it fails.
MODEL_FETCH = "model-fetch"

# What the model-fetch init container reads, per URI scheme: the keys of
# model.credentialsSecretRef it gets as environment variables. An endpoint comes from the same
# Secret as the credentials it receives, so no spec field can send them elsewhere.
FETCH_CREDENTIAL_KEYS = {
    "hf": ("HF_TOKEN", "HF_ENDPOINT"),
    "s3": (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_REGION",
        "AWS_DEFAULT_REGION",
        "AWS_ENDPOINT_URL",
    ),
}
