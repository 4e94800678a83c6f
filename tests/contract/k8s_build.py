"""The subset of kustomize that compose/k8s uses, in Python, for the manifest tests.

`build(folder)` reads a kustomization.yaml and returns its objects the way
`kubectl kustomize folder` does for the fields used there: `resources` (files, or folders
holding a kustomization), `patches` by `path` (strategic merge: lists of containers,
volumes, env and mounts merge by their key, new items first; other lists are replaced;
a patch whose top level says `$patch: delete` removes its object) and `namespace`.
A field it does not know fails the build, so that the tests never check less than
kubectl would apply.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]

_KNOWN_FIELDS = {"apiVersion", "kind", "namespace", "resources", "patches"}
# Kinds that live in no namespace (a kustomization's `namespace` leaves them alone).
CLUSTER_SCOPED = {"Namespace"}
# Strategic merge keys of the lists the patches touch (from the Kubernetes API's
# x-kubernetes-patch-merge-key); any other list is replaced whole.
_MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name",
               "env": "name", "volumeMounts": "mountPath", "ports": "containerPort"}
_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def load_documents(path: Path) -> list[Doc]:
    """Every non-empty YAML document of a file."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def build(folder: Path) -> list[Doc]:
    """The objects `kubectl kustomize folder` would print (in file order)."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(kustomization) - _KNOWN_FIELDS
    assert not unknown, f"{folder}: kustomization fields this resolver lacks: {unknown}"
    docs: list[Doc] = []
    for entry in kustomization["resources"]:
        path = (folder / entry).resolve()
        assert path.exists(), f"{folder}/kustomization.yaml lists {entry}, which is missing"
        docs += build(path) if path.is_dir() else load_documents(path)
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path"}, f"{folder}: only `path` patches are resolved: {patch}"
        for change in load_documents(folder / patch["path"]):
            target = find(docs, change["kind"], change["metadata"]["name"])
            if change.get("$patch") == "delete":
                docs.remove(target)
                continue
            docs[docs.index(target)] = strategic_merge(target, change)
    namespace = kustomization.get("namespace")
    if namespace:
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = namespace
    return docs


def find(docs: list[Doc], kind: str, name: str) -> Doc:
    """The one object of `kind` named `name`."""
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind} objects named {name}"
    return found[0]


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """`patch` merged over `base` as a strategic merge patch of these kinds does it."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            merged[key] = strategic_merge(base[key], value, key) if key in base else value
        return merged
    if isinstance(base, list) and isinstance(patch, list) and field in _MERGE_KEYS:
        key = _MERGE_KEYS[field]
        merged_list, added = copy.deepcopy(base), []
        for item in patch:
            same = [i for i, old in enumerate(merged_list) if old[key] == item[key]]
            if same:
                merged_list[same[0]] = strategic_merge(merged_list[same[0]], item)
            else:
                added.append(copy.deepcopy(item))
        return added + merged_list  # kustomize puts new items first
    return copy.deepcopy(patch)


def pod_spec(deployment: Doc) -> Doc:
    """The pod template's spec."""
    spec: Doc = deployment["spec"]["template"]["spec"]
    return spec


def container_env(container: Doc, docs: list[Doc], *, pod_ip: str, secret_value: str
                  ) -> dict[str, str]:
    """The environment the kubelet would give `container`: ConfigMap keys looked up in
    `docs` (missing ones fail), Secret keys as `secret_value`, `$(VAR)` expanded."""
    assert "envFrom" not in container, "envFrom hides which variables a service gets"
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        name = entry["name"]
        if "value" in entry:
            env[name] = _REFERENCE.sub(lambda m: env.get(m.group(1), m.group(0)),
                                       entry["value"])
            continue
        source = entry["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            data = find(docs, "ConfigMap", ref["name"])["data"]
            assert ref["key"] in data, f"{name}: ConfigMap {ref['name']} has no {ref['key']}"
            env[name] = data[ref["key"]]
        elif "secretKeyRef" in source:
            env[name] = secret_value
        elif source.get("fieldRef", {}).get("fieldPath") == "status.podIP":
            env[name] = pod_ip
        else:
            raise AssertionError(f"{name}: unexpected valueFrom {source}")
    return env
