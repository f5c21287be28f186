"""What a pod's manifest draws on, as the kubelet would hand it over: ConfigMaps and Secrets
(mounted as files or read into ``env``), ``emptyDir`` volumes and the downward API.

``PodSources`` answers from the rendered objects and the Secrets a test passes in; files are
written already translated for this machine (``translate.localize_file``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from localpods.translate import Resolve, localize_file

Obj = dict[str, Any]
_SHM = Path("/dev/shm")


class PodSources:
    """The ConfigMaps among ``children``, the ``secrets`` (name -> data) and the namespace."""

    def __init__(self, children: list[Obj], secrets: dict[str, dict[str, str]], namespace: str):
        self.config_maps = {
            o["metadata"]["name"]: o.get("data", {}) for o in children if o["kind"] == "ConfigMap"
        }
        self.secrets = secrets
        self.namespace = namespace

    def config_map(self, name: str) -> dict[str, str]:
        if name not in self.config_maps:
            raise ValueError(f"ConfigMap {name!r} is not among the rendered objects")
        return self.config_maps[name]

    def config_files(self, spec: Obj) -> dict[str, str]:
        """Every file the pod's ConfigMap volumes hold (name -> text), as rendered."""
        return {
            key: text
            for volume in spec.get("volumes", [])
            if "configMap" in volume
            for key, text in self.config_map(volume["configMap"]["name"]).items()
        }

    @staticmethod
    def volume_dir(volume: Obj, pod_dir: Path) -> Path:
        """Where a volume lives here: a directory of the pod's, or the machine's /dev/shm."""
        if volume.get("emptyDir", {}).get("medium") == "Memory":
            return _SHM  # shared by the pod's containers, as in the pod
        if not {"configMap", "secret", "emptyDir"} & set(volume):
            raise ValueError(f"volume {volume['name']!r} ({sorted(volume)}) can't run locally")
        path = pod_dir / "volumes" / volume["name"]
        path.mkdir(parents=True)
        return path

    def fill_volume(
        self,
        volume: Obj,
        path: Path,
        ports: dict[int, int],
        mounts: list[tuple[str, Path]],
        resolve: Resolve,
    ) -> None:
        """Writes a ConfigMap's or Secret's files into ``path`` (config files translated)."""
        if "configMap" in volume:
            for key, text in self.config_map(volume["configMap"]["name"]).items():
                (path / key).write_text(localize_file(key, text, ports, mounts, resolve))
        elif "secret" in volume:
            secret = volume["secret"]["secretName"]
            if secret not in self.secrets:
                raise ValueError(f"the pods mount Secret {secret!r}: pass it in secrets=")
            data = self.secrets[secret]
            items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                (path / item["path"]).write_text(data[item["key"]])

    def env_value(self, item: Obj, pod: str) -> str:
        """One ``env`` entry's value for the pod named ``pod``."""
        if "value" in item:
            return str(item["value"])
        source = item.get("valueFrom", {})
        if "fieldRef" in source:
            field = source["fieldRef"]["fieldPath"]
            values = {
                "status.podIP": "127.0.0.1",
                "status.hostIP": "127.0.0.1",
                "metadata.name": pod,
                "metadata.namespace": self.namespace,
                "spec.nodeName": "localhost",
            }
            if field not in values:
                raise ValueError(f"env {item['name']}: fieldRef {field} is not supported locally")
            return values[field]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            return self.config_map(ref["name"])[ref["key"]]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            value = self.secrets.get(ref["name"], {}).get(ref["key"])
            if value is None:
                raise ValueError(
                    f"env {item['name']} reads key {ref['key']!r} of Secret {ref['name']!r}: "
                    "pass it in secrets= (run.py: --secret NAME=KEY=VALUE)"
                )
            return value
        raise ValueError(f"env {item['name']}: {sorted(source)} is not supported locally")
