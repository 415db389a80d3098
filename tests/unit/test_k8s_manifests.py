"""deploy/k8s: every manifest is valid Kubernetes (offline schemas of
``kubernetes-validate``), the kustomization lists exactly the files there, the
pieces refer to each other (selectors, ports, volumes, Services, the ConfigMap and
the Secret), and every container starts its daemon with flags and a gcache.toml
that the daemon's own argument parser and config loader accept."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gcache import config as cfgmod
from gcache.auth import load_cluster_token
from gcache.config import MetaConfig, RouterConfig, ServerConfig
from gcache.errors import ConfigError
from gcache.startup import OneLineParser

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
KUSTOMIZATION = K8S / "kustomization.yaml"
# Kubernetes releases whose schemas every manifest must pass: an old one still in
# wide use and the newest kubernetes-validate ships.
VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
# Kustomization fields the base may use: each resolves without kustomize itself
# (no generators, patches or remote bases that this test could not check).
KUSTOMIZE_FIELDS = {"apiVersion", "kind", "namespace", "labels", "resources", "images"}
# Each daemon's parser and config class, built the way its main() builds them.
DAEMONS: dict[str, type] = {
    "gcache-meta": MetaConfig,
    "gcache-server": ServerConfig,
    "gcache-router": RouterConfig,
}
# Plausible values of the downward-API variables (documentation addresses).
FIELD_VALUES = {
    "status.podIP": "192.0.2.17",
    "status.hostIP": "192.0.2.5",
    "spec.nodeName": "node-a",
    "metadata.name": "gcache-meta-7d9f8b6c5-x2kq4",
    "metadata.namespace": "gcache",
}
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
ETCD = shutil.which("etcd") or "/usr/bin/etcd"


def _kustomization() -> dict[str, Any]:
    data = yaml.safe_load(KUSTOMIZATION.read_text())
    assert isinstance(data, dict)
    return data


def _docs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name in _kustomization()["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            if doc is not None:
                out.append((name, doc))
    return out


DOCS = _docs()


def _ids(docs: list[tuple[str, dict[str, Any]]]) -> list[str]:
    return [f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in docs]


def _find(kind: str, name: str) -> dict[str, Any]:
    hits = [d for _, d in DOCS if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind} {name}, found {len(hits)}"
    return hits[0]


def _workloads() -> list[dict[str, Any]]:
    return [d for _, d in DOCS if d["kind"] in WORKLOADS]


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _daemon_containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) of every container that runs a GCache daemon."""
    out = []
    for w in _workloads():
        for c in w["spec"]["template"]["spec"]["containers"]:
            if c["command"][0] in DAEMONS:
                out.append((w, c))
    return out


def _toml(tmp_path: Path) -> Path:
    cm = _find("ConfigMap", "gcache-config")
    path = tmp_path / "gcache.toml"
    path.write_text(cm["data"]["gcache.toml"])
    return path


def _env_values(container: dict[str, Any]) -> dict[str, str]:
    values = {}
    for env in container.get("env", []):
        if "value" in env:
            values[env["name"]] = env["value"]
        else:
            field = env["valueFrom"]["fieldRef"]["fieldPath"]
            assert field in FIELD_VALUES, f"{env['name']}: no plausible value for {field}"
            values[env["name"]] = FIELD_VALUES[field]
    return values


def _expand(container: dict[str, Any]) -> list[str]:
    """The container's args as Kubernetes expands them: ``$(VAR)`` of a variable
    the container defines. One it does not define would reach the daemon
    literally, so it fails here."""
    values = _env_values(container)
    out = []
    for arg in container.get("args", []):
        for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
            assert var in values, f"{container['name']}: $({var}) is not in its env"
        out.append(re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: values[m.group(1)], arg))
    return out


def _parser(prog: str, cls: type) -> argparse.ArgumentParser:
    parser = OneLineParser(prog=prog)
    cfgmod.add_arguments(parser, cls)
    parser.add_argument("--log-level", default="info")
    return parser


def _parse(prog: str, argv: list[str]) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return _parser(prog, DAEMONS[prog]).parse_args(argv)
    except SystemExit:
        pytest.fail(f"{prog} refuses its args {argv}: {err.getvalue().strip()}", pytrace=False)


def _mount_of(container: dict[str, Any], path: str) -> dict[str, Any]:
    """The volumeMount ``path`` is in (the longest mount path that holds it)."""
    best = None
    for m in container.get("volumeMounts", []):
        mp = m["mountPath"].rstrip("/")
        if (path == mp or path.startswith(mp + "/")) and (
            best is None or len(mp) > len(best["mountPath"])
        ):
            best = m
    assert best is not None, f"{container['name']}: {path} is on no volume"
    return best


def _volume(workload: dict[str, Any], name: str) -> dict[str, Any]:
    vols = {v["name"]: v for v in workload["spec"]["template"]["spec"].get("volumes", [])}
    assert name in vols, f"{workload['metadata']['name']}: no volume {name}"
    return vols[name]


def _port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    by_name = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
    assert port in by_name, f"{container['name']}: no port named {port}"
    return int(by_name[port])


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


# ---- the kustomization -------------------------------------------------------------


def test_kustomization_lists_every_manifest_once_and_only_existing_ones() -> None:
    kust = _kustomization()
    assert set(kust) <= KUSTOMIZE_FIELDS, (
        f"fields not checked offline: {set(kust) - KUSTOMIZE_FIELDS}"
    )
    resources = kust["resources"]
    assert len(resources) == len(set(resources)), "a resource listed twice"
    for name in resources:
        assert (K8S / name).is_file(), f"kustomization lists {name}, which does not exist"
    on_disk = {p.name for p in K8S.iterdir() if p.suffix in (".yaml", ".yml")}
    assert on_disk - {KUSTOMIZATION.name} == set(resources), "a manifest not in the kustomization"


def test_every_resource_is_in_the_namespace_the_kustomization_sets() -> None:
    ns = _kustomization()["namespace"]
    assert _find("Namespace", ns)
    for _, doc in DOCS:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == ns, doc["metadata"]["name"]


def test_images_the_kustomization_sets_are_the_ones_the_containers_name() -> None:
    names = {i["name"] for i in _kustomization()["images"]}
    used = {c["image"] for w in _workloads() for c in _containers(w["spec"]["template"]["spec"])}
    assert names <= used, f"images entries that match no container: {names - used}"
    assert "gcache" in used


# ---- schemas -----------------------------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("file", "doc"), DOCS, ids=_ids(DOCS))
def test_manifest_validates_against_the_kubernetes_schema(
    file: str, doc: dict[str, Any], version: str
) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = "/".join(str(p) for p in exc.path)
        pytest.fail(f"{file} {doc['kind']}: {path}: {exc.message} (k8s {version})", pytrace=False)


def test_the_schema_check_refuses_a_misspelt_field_and_a_wrong_type() -> None:
    """The offline schemas really catch mistakes (strict: unknown fields too)."""
    meta = _find("Deployment", "gcache-meta")
    typo = yaml.safe_load(yaml.safe_dump(meta))
    typo["spec"]["replica"] = typo["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, VERSIONS[-1], strict=True)
    wrong = yaml.safe_load(yaml.safe_dump(meta))
    wrong["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "7700"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, VERSIONS[-1], strict=True)


# ---- references between the pieces ------------------------------------------------


@pytest.mark.parametrize("w", _workloads(), ids=lambda w: w["metadata"]["name"])
def test_workload_selector_volumes_and_config_references_resolve(w: dict[str, Any]) -> None:
    pod = w["spec"]["template"]
    labels = pod["metadata"]["labels"]
    for k, v in w["spec"]["selector"]["matchLabels"].items():
        assert labels.get(k) == v, f"selector {k}={v} does not match the pod template"
    claims = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
    volumes = {v["name"]: v for v in pod["spec"].get("volumes", [])}
    for c in _containers(pod["spec"]):
        for m in c.get("volumeMounts", []):
            assert m["name"] in volumes or m["name"] in claims, f"{c['name']}: {m['name']}"
    for v in volumes.values():
        if "configMap" in v:
            _find("ConfigMap", v["configMap"]["name"])
        if "secret" in v:
            _find("Secret", v["secret"]["secretName"])
    if w["kind"] == "StatefulSet":
        _find("Service", w["spec"]["serviceName"])


@pytest.mark.parametrize(
    "svc", [d for _, d in DOCS if d["kind"] == "Service"], ids=lambda s: s["metadata"]["name"]
)
def test_service_selects_a_workload_and_its_ports_exist(svc: dict[str, Any]) -> None:
    sel = svc["spec"]["selector"]
    matched = [
        w
        for w in _workloads()
        if all(w["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in sel.items())
    ]
    assert len(matched) == 1, f"{svc['metadata']['name']} selects {len(matched)} workloads"
    containers = matched[0]["spec"]["template"]["spec"]["containers"]
    names = {p.get("name") for c in containers for p in c.get("ports", [])}
    numbers = {p["containerPort"] for c in containers for p in c.get("ports", [])}
    for p in svc["spec"]["ports"]:
        target = p.get("targetPort", p["port"])
        assert target in names or target in numbers, f"{svc['metadata']['name']}: {target}"


# ---- the daemons accept what the manifests give them --------------------------------


def test_configmap_gcache_toml_loads_for_every_daemon(tmp_path: Path) -> None:
    path = _toml(tmp_path)
    for cls in DAEMONS.values():
        cfgmod.load(cls, str(path), env={})
    # ...and the loader would refuse a bad key there (the check can fail).
    bad = tmp_path / "bad.toml"
    bad.write_text(path.read_text().replace("[server]\n", "[server]\ncapacityy = 1\n", 1))
    with pytest.raises(ConfigError, match="capacityy"):
        cfgmod.load(MetaConfig, str(bad), env={})


@pytest.mark.parametrize(
    ("w", "c"), _daemon_containers(), ids=[c["command"][0] for _, c in _daemon_containers()]
)
def test_daemon_accepts_its_args_and_the_config(
    w: dict[str, Any], c: dict[str, Any], tmp_path: Path
) -> None:
    prog = c["command"][0]
    assert c["command"] == [prog], f"{prog} must be the container's first process"
    argv = _expand(c)
    args = _parse(prog, argv)
    # The config file is the ConfigMap's gcache.toml, mounted where --config says.
    assert args.config, f"{prog}: no --config"
    mount = _mount_of(c, args.config)
    assert "configMap" in _volume(w, mount["name"])
    args.config = str(_toml(tmp_path))
    try:
        cfg = cfgmod.from_args(DAEMONS[prog], args)
    except ConfigError as exc:
        pytest.fail(f"{prog} {' '.join(argv)}: {exc}", pytrace=False)
    ports = {p["containerPort"] for p in c.get("ports", [])}
    if prog == "gcache-meta":
        assert cfg.host == "0.0.0.0"
        assert {cfg.port, cfg.grpc_port, cfg.metrics_port} <= ports
        assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        for probe in ("readinessProbe", "livenessProbe"):
            assert _port(c, c[probe]["httpGet"]["port"]) == cfg.metrics_port
    if prog == "gcache-server":
        pod = w["spec"]["template"]["spec"]
        assert w["kind"] == "DaemonSet" and pod["hostNetwork"] is True
        assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"  # resolves gcache-etcd
        assert cfg.port in ports
        # The segment and the NVMe tier are on host paths (they outlive the pod);
        # the segment's in the host's tmpfs.
        shm = _volume(w, _mount_of(c, cfg.shm_dir)["name"])
        assert shm["hostPath"]["path"].startswith("/dev/shm/")
        assert cfg.nvme_size_bytes > 0
        assert "hostPath" in _volume(w, _mount_of(c, cfg.nvme_path)["name"])
        # The same id in every pod on this node (the node's name), so a new pod
        # re-adopts the segment; clients reach it at the node's address.
        assert cfg.server_id == FIELD_VALUES["spec.nodeName"]
        assert args.advertise_host == FIELD_VALUES["status.hostIP"]
        # Its memory limit holds the segment and the staging file it populates.
        limit = cfgmod.parse_size(c["resources"]["limits"]["memory"])
        assert limit >= cfg.capacity_bytes + cfg.staging_size_bytes + (1 << 30)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert _port(c, c[probe]["tcpSocket"]["port"]) == cfg.port
    if prog == "gcache-router":
        assert cfg.host == "0.0.0.0" and {cfg.port, cfg.http_port} <= ports
        assert _port(c, c["readinessProbe"]["httpGet"]["port"]) == cfg.http_port
    if prog in ("gcache-meta", "gcache-server"):
        # The cluster token file is on the Secret's volume.
        assert cfg.cluster_token_file
        assert "secret" in _volume(w, _mount_of(c, cfg.cluster_token_file)["name"])
    # Everyone finds the meta leader through the etcd client Service.
    etcd_addr = args.etcd if prog == "gcache-meta" else args.meta
    m = re.fullmatch(r"etcd://([^:/]+):(\d+)/(\w+)", etcd_addr or "")
    assert m, f"{prog}: not an etcd:// address: {etcd_addr!r}"
    svc = _find("Service", m.group(1))
    assert int(m.group(2)) in {p["port"] for p in svc["spec"]["ports"]}
    assert (
        svc["spec"]["selector"]
        == _find("StatefulSet", "gcache-etcd")["spec"]["selector"]["matchLabels"]
    )


def test_every_daemon_uses_the_same_etcd_prefix() -> None:
    addrs = set()
    for _, c in _daemon_containers():
        for arg in c["args"]:
            if "etcd://" in arg:
                addrs.add(arg.split("=", 1)[1])
    assert len(addrs) == 1, addrs


def test_base_cluster_token_is_refused_so_an_overlay_must_set_one(tmp_path: Path) -> None:
    secret = _find("Secret", "gcache-cluster-token")
    token = secret["stringData"]["cluster.token"]
    path = tmp_path / "cluster.token"
    path.write_text(token)
    with pytest.raises(ConfigError, match="at least"):
        load_cluster_token(str(path), env={})


# ---- etcd --------------------------------------------------------------------------


def test_etcd_members_and_flags() -> None:
    sts = _find("StatefulSet", "gcache-etcd")
    [c] = sts["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["etcd"]
    args = dict(a.removeprefix("--").split("=", 1) for a in _expand(c))
    # One --initial-cluster entry per replica, each the URL that member advertises.
    name = sts["metadata"]["name"]
    peer = sts["spec"]["serviceName"]
    ns = FIELD_VALUES["metadata.namespace"]
    members = dict(m.split("=", 1) for m in args["initial-cluster"].split(","))
    assert sorted(members) == [f"{name}-{i}" for i in range(sts["spec"]["replicas"])]
    for member, url in members.items():
        assert url == f"http://{member}.{peer}.{ns}.svc:2380"
    pod = FIELD_VALUES["metadata.name"]
    assert args["initial-advertise-peer-urls"] == f"http://{pod}.{peer}.{ns}.svc:2380"
    assert args["name"] == pod
    assert _find("Service", peer)["spec"]["clusterIP"] == "None"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    # Every flag is one etcd knows (the Debian etcd the HA tests use).
    if not os.path.exists(ETCD):
        if _ci():
            pytest.fail(f"{ETCD} missing: install etcd-server", pytrace=False)
        pytest.skip(f"{ETCD} missing")
    out = subprocess.run([ETCD, "--help"], capture_output=True, text=True, timeout=30)
    known = set(re.findall(r"^\s+--([a-z0-9-]+)", out.stdout + out.stderr, re.MULTILINE))
    assert known, "etcd --help listed no flags"
    assert set(args) <= known, f"flags etcd does not know: {set(args) - known}"
