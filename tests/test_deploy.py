"""Deployment: the systemd unit, the config file, readiness notification, crash recovery, fstab."""

from __future__ import annotations

import contextlib
import grp
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epochfs.cli import build_parser
from epochfs.cli.options import config_from, example_config, mount_options
from epochfs.core.errors import ConfigError
from epochfs.dev.sample import SampleFile, sample_layout, upload

from .conftest import requires_fuse
from .helpers import EPOCHFS, drop_all_caches, read_all

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "deploy" / "systemd" / "epochfs@.service"
EXAMPLE = ROOT / "deploy" / "epochfs.example.toml"


def test_systemd_unit_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is missing: scripts/bootstrap.sh installs it (apt package systemd)"
    epochfs = Path(sys.executable).with_name("epochfs")
    unit = tmp_path / "epochfs@data.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/epochfs", str(epochfs)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    text = UNIT.read_text()
    for line in ("Type=notify", "Restart=on-failure", "ExecStopPost=-", "After=network-online.target",
                 "NoNewPrivileges=yes", "DeviceAllow=/dev/fuse rw", "RestrictAddressFamilies=",
                 "CapabilityBoundingSet=CAP_SYS_ADMIN", "--config /etc/epochfs/%i.toml --foreground"):
        assert line in text, line
    for forbidden in ("ProtectSystem=", "PrivateTmp=yes", "ProtectHome=", "PrivateDevices=yes"):
        assert f"\n{forbidden}" not in text, f"{forbidden} would hide the mount from the host"


def test_the_cache_node_unit_verifies(tmp_path):
    """deploy/systemd/epochfs-serve@.service: a notify service of `epochfs serve` that stops by handing its
    share over (SIGTERM, time for it), with the protections a service that mounts nothing can have."""
    analyze = shutil.which("systemd-analyze")
    assert analyze
    epochfs = Path(sys.executable).with_name("epochfs")
    source = ROOT / "deploy" / "systemd" / "epochfs-serve@.service"
    unit = tmp_path / "epochfs-serve@imagenet.service"
    unit.write_text(source.read_text().replace("/usr/local/bin/epochfs", str(epochfs)))
    result = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    text = source.read_text()
    for line in ("Type=notify", "serve --config /etc/epochfs/serve-%i.toml --foreground", "KillSignal=SIGTERM",
                 "Restart=on-failure", "ProtectSystem=strict", "PrivateDevices=yes", "CapabilityBoundingSet=\n"):
        assert line in text, line


def test_the_units_verify_before_install_as_their_header_says(tmp_path):
    """The units' header: render them with this install's paths, then `systemd-analyze verify` them (as
    they are in the checkout they name /usr/local/bin/epochfs, which only install.sh makes)."""
    header = [ln[1:].strip() for ln in UNIT.read_text().splitlines() if ln.startswith("#   ")]
    render = next(ln for ln in header if "--render-units" in ln)
    verify = next(ln for ln in header if ln.startswith("systemd-analyze verify"))
    units = tmp_path / "units"
    bindir = Path(sys.executable).parent
    cmd = render.replace("$PWD/.venv/bin", str(bindir)).replace("/tmp/units", str(units))
    r = subprocess.run(["bash", "-c", cmd], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"ExecStart={bindir}/epochfs mount --config /etc/epochfs/%i.toml" in (units / "epochfs@.service").read_text()
    r = subprocess.run(["bash", "-c", verify.replace("/tmp/units", str(units))], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    env = {**os.environ, "EPOCHFS_PREFIX": "/srv/epochfs", "EPOCHFS_ETC": "/srv/etc", "EPOCHFS_BINDIR": "/srv/bin"}
    r = subprocess.run(["bash", str(ROOT / "deploy" / "install.sh"), "--render-units", str(tmp_path / "p")], env=env,
                       capture_output=True, text=True, timeout=60)
    text = (tmp_path / "p" / "epochfs@.service").read_text()
    assert "ExecStart=/srv/bin/epochfs mount --config /srv/etc/%i.toml" in text and "/usr/local/bin" not in text
    assert "file:/srv/epochfs/README.md" in text


@requires_fuse
def test_the_jobs_client_installs_from_its_wheel_with_no_index_and_reaches_a_mount(tmp_path, s3_client, fresh_bucket,
                                                                                  mount_factory):
    """The README's two lines for the training job's environment, as pasted: the wheel built by
    scripts/client-wheel.sh, installed with --no-deps into a fresh virtualenv with no package index,
    gives the job's API and commands (status through a real mount, the sampler's hand-over client,
    watch); the daemon's commands there say what they need instead of a traceback."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("**The client in the training job's environment.**"):]
    block = block[block.index("```sh\n") + 6:]
    lines = [ln.split("#")[0].strip() for ln in block[:block.index("```")].splitlines()]
    build, install = lines[0], lines[1]
    assert build == "bash scripts/client-wheel.sh" and install.startswith("pip install --no-deps dist/")
    out = tmp_path / "dist"
    r = subprocess.run(["bash", "scripts/client-wheel.sh", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    wheel = Path(r.stdout.strip())
    assert wheel.name == install.split("/")[-1], (wheel, install)
    venv = tmp_path / "job-env"
    subprocess.run(["/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable, "-m", "venv",
                    str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "pip"), *install.split()[1:-1], "--no-index", str(wheel)]
    r = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    files = [SampleFile(f"d/{i}.bin", 5000 + i) for i in range(4)]
    upload(s3_client, fresh_bucket, "", files)
    with mount_factory(f"s3://{fresh_bucket}") as m:
        status = subprocess.run([str(venv / "bin" / "epochfs"), "status", str(m.mountpoint)], capture_output=True,
                                text=True, timeout=60)
        assert status.returncode == 0 and status.stdout.startswith("mount "), status.stderr
        script = ("import sys, epochfs, epochfs.watch\n"
                  "c = epochfs.Client(sys.argv[1])\n"
                  "c.prefetch(['d/0.bin', 'd/1.bin'])\n"
                  "for _ in epochfs.watch.watch(iter(range(3)), sys.argv[1], job='client-wheel', interval=0.01):\n"
                  "    pass\n"
                  "print(c.status()['prefetch']['files'])\n")
        r = subprocess.run([str(venv / "bin" / "python"), "-c", script, str(m.mountpoint)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and r.stdout.strip() == "2", (r.stdout, r.stderr)
    r = subprocess.run([str(venv / "bin" / "epochfs"), "mount", "s3://b", str(tmp_path / "x")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "needs the node's packages" in r.stderr and "Traceback" not in r.stderr, r.stderr


def parse_mount(argv: list[str]):
    return config_from(build_parser().parse_args(argv))


def test_example_config_is_generated_from_the_options_and_flags_override_it(tmp_path):
    assert EXAMPLE.read_text() == example_config(), "regenerate it: bash scripts/example-config.sh"
    cfg = parse_mount(["mount", "--config", str(EXAMPLE)])
    assert cfg.source.url == "s3://training-data/imagenet/" and str(cfg.mountpoint) == "/mnt/data"
    assert str(cfg.cache_dir) == "/var/cache/epochfs/data" and cfg.allow_other
    assert cfg.eviction == "manifest" and cfg.metrics_addr is None and cfg.cache_size == 10 << 30
    cfg = parse_mount(["mount", "--config", str(EXAMPLE), "--cache-size", "1G", "--eviction", "lru"])
    assert cfg.cache_size == 1 << 30 and cfg.eviction == "lru"
    # every mount option has a key in the example (set or commented out), and uncommenting the
    # commented ones gives a valid config
    keys = set(re.findall(r"^#? ?([a-z_]+) = ", EXAMPLE.read_text(), flags=re.M))
    assert {mo.key for mo in mount_options()} - keys == {"foreground"}  # the unit passes --foreground itself
    uncommented = tmp_path / "all.toml"
    text = re.sub(r"^# ([a-z_]+ = )", r"\1", EXAMPLE.read_text(), flags=re.M)
    # The example names a group an operator makes; this node may have none of that name (and another
    # test may be using it), so a group of the test's own stands in for it, made here and removed after.
    assert 'control_group = "epochfs-operators"' in text
    with own_group() as group:
        uncommented.write_text(text.replace('control_group = "epochfs-operators"', f'control_group = "{group}"'))
        cfg = parse_mount(["mount", "--config", str(uncommented)])
        assert cfg.control_group == grp.getgrnam(group).gr_gid
    assert cfg.endpoint_url == "http://10.0.0.5:9000" and cfg.file_mode == 0o444 and cfg.fuse_options == (
        "max_read=1048576",)


@contextlib.contextmanager
def own_group():
    """A group of this test's own (made with groupadd as root; else the process's own group, which
    exists), removed afterwards."""
    if os.geteuid() != 0 or shutil.which("groupadd") is None:
        yield grp.getgrgid(os.getgid()).gr_name
        return
    name = f"epochfs-t{os.getpid()}"
    subprocess.run(["groupadd", "--system", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["groupdel", name], capture_output=True)


@pytest.mark.parametrize("text,message", [
    ('source = "s3://b"\ncache_sise = "1G"\n', "unknown key 'cache_sise': did you mean 'cache_size'\\?"),
    ('source = "s3://b"\nzzz = 1\n', "unknown key 'zzz': the keys are the mount options' long names"),
    ('source = "s3://b"\ncache_size = "lots"\n', "cache_size: not a size"),
    ('source = "s3://b"\neviction = "random"\n', "--eviction 'random': choose manifest"),
    ('allow_other = "yes"\n', "allow_other: expected true or false"),
    ("[section]\nx = 1\n", "tables are not supported"),
    ("cache_size = \n", "config file"),
])
def test_config_file_errors_name_the_key(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        parse_mount(["mount", "--config", str(path), "s3://b", "/mnt/x"])
    result = subprocess.run([*EPOCHFS, "mount", "--config", str(path), "s3://b", str(tmp_path)],
                            capture_output=True, text=True)
    assert result.returncode == 2 and str(path) in result.stderr


@requires_fuse
def test_readiness_is_notified_only_when_the_mount_answers(tmp_path, s3, sample_bucket):
    sock_path = str(tmp_path / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(sock_path)
    listener.settimeout(60)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = s3.env() | {"NOTIFY_SOCKET": sock_path}
    proc = subprocess.Popen([*EPOCHFS, "mount", f"s3://{sample_bucket}/data", str(mnt), "--endpoint-url", s3.endpoint,
                             "--cache-dir", str(tmp_path / "cache"), "--foreground", "--metrics-addr", "off"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        message = listener.recv(4096).decode()
        answered = os.listdir(mnt)  # at READY=1 the mount already answers
        assert "READY=1" in message and f"MAINPID={proc.pid}" in message
        assert answered
        proc.send_signal(signal.SIGTERM)
        assert "STOPPING=1" in listener.recv(4096).decode()
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        listener.close()


@requires_fuse
@pytest.mark.page_cache
def test_kill_9_under_a_reader_then_mount_again_recovers_warm(s3, s3_client, fresh_bucket, mount_factory):
    files = sample_layout(small=40, large=1, large_mib=8, seed=21)
    upload(s3_client, fresh_bucket, "", files)
    m = mount_factory(f"s3://{fresh_bucket}", "--block-size", "1M")
    m.start()
    for f in files[:30]:
        assert read_all(m.path(f.key)) == f.content()
    time.sleep(0.5)  # let write-behind fills land
    pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))
    big = next(f for f in files if f.size > 4 << 20)
    # A reader that needs the daemon at every pass (its pages dropped each time: a file held in the page
    # cache is read with no request at all, so it would go on reading its verified bytes without one).
    reader = subprocess.Popen([sys.executable, "-c",
                               "import os\nwhile True:\n"
                               f"    with open({str(m.path(big.key))!r}, 'rb') as f:\n"
                               "        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)\n"
                               "        f.read()\n"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.3)
    os.kill(pid, signal.SIGKILL)
    reader.wait(timeout=30)  # the reader gets an error (ENOTCONN), it does not hang
    with pytest.raises(OSError):
        os.listdir(m.mountpoint)
    gets_before = s3.request_count(fresh_bucket)
    m.start()  # same mount point: the dead mount is cleared, the cache comes back
    assert "dead FUSE mount" in m.log()
    status = m.status()
    assert status["store"]["blocks"] > 0
    drop_all_caches()
    for f in files[:30]:
        assert read_all(m.path(f.key)) == f.content()
    after = m.status()["cache"]
    assert after["misses"] == 0, "blocks cached before the crash were fetched again"
    assert s3.request_count(fresh_bucket) == gets_before
    for f in files[30:]:
        assert read_all(m.path(f.key)) == f.content()
    m.stop()


@requires_fuse
def test_fstab_line_mounts_and_unmounts(tmp_path, s3, sample_bucket, sample_files):
    helper = Path("/sbin/mount.epochfs")
    ours = Path(sys.executable).with_name("mount.epochfs")
    installed = False
    if not helper.exists():
        helper.symlink_to(ours)
        installed = True
    try:
        mnt = tmp_path / "fstab-mnt"
        mnt.mkdir()
        fstab = tmp_path / "fstab"
        fstab.write_text(
            f"s3://{sample_bucket}/data {mnt} epochfs endpoint_url={s3.endpoint},cache_dir={tmp_path / 'c'},"
            f"cache_size=1G,metrics_addr=off,_netdev,nofail,noauto 0 0\n")
        env = s3.env() | {"PATH": f"{ours.parent}:{os.environ['PATH']}"}
        result = subprocess.run(["mount", "-T", str(fstab), str(mnt)], env=env, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr
        assert os.path.ismount(mnt)
        f = sample_files[17]
        assert read_all(mnt / f.key) == f.content()
        result = subprocess.run(["umount", str(mnt)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert not os.path.ismount(mnt)
    finally:
        subprocess.run(["fusermount3", "-uz", str(tmp_path / "fstab-mnt")], capture_output=True)
        if installed:
            helper.unlink()


def test_install_gives_each_instance_its_own_metrics_port(tmp_path):
    env = dict(os.environ, EPOCHFS_ETC=str(tmp_path / "etc"))
    ports = []
    for name in ("data", "val", "ckpt"):
        r = subprocess.run(["bash", str(ROOT / "deploy" / "install.sh"), "--config-only", name], env=env,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        cfg = parse_mount(["mount", "--config", str(tmp_path / "etc" / f"{name}.toml")])
        assert str(cfg.mountpoint) == f"/mnt/{name}" and str(cfg.cache_dir) == f"/var/cache/epochfs/{name}"
        ports.append(cfg.metrics_addr)
    assert ports == ["127.0.0.1:9567", "127.0.0.1:9568", "127.0.0.1:9569"]
    r = subprocess.run(["bash", str(ROOT / "deploy" / "install.sh"), "--config-only", "val"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "left as it is" in r.stdout  # an existing config is never overwritten


def test_install_writes_a_cache_nodes_config_the_serve_unit_runs(tmp_path):
    """`install.sh --serve NAME` is a cache node: its config (serve-NAME.toml, what epochfs-serve@NAME
    reads) is a valid `epochfs serve` config with its own cache directory and metrics port."""
    env = dict(os.environ, EPOCHFS_ETC=str(tmp_path / "etc"))
    r = subprocess.run(["bash", str(ROOT / "deploy" / "install.sh"), "--config-only", "data"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(["bash", str(ROOT / "deploy" / "install.sh"), "--config-only", "--serve", "imagenet"], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and "peer_listen" in r.stdout, r.stderr
    path = tmp_path / "etc" / "serve-imagenet.toml"
    cfg = config_from(build_parser().parse_args(["serve", "--config", str(path)]), serving=True)
    assert cfg.serving and str(cfg.cache_dir) == "/var/cache/epochfs/serve-imagenet" and cfg.rebalance
    assert cfg.metrics_addr == "127.0.0.1:9568" and cfg.peer_listen and cfg.replicas == 2
    unit = (ROOT / "deploy" / "systemd" / "epochfs-serve@.service").read_text()
    assert "/etc/epochfs/serve-%i.toml" in unit
    bad = subprocess.run(["bash", str(ROOT / "deploy" / "install.sh"), "--config-only", "--serve", "../x"], env=env,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "not an instance name" in bad.stderr


def test_the_bare_metal_walkthrough_configures_a_tier(tmp_path):
    """docs/deploying.md's bare-metal steps 1 to 3, run as written, steps 2 and 3 as on two machines (each
    its own /etc/epochfs, the secrets made once in step 1 copied to both): a cache node's config and a GPU
    node's, which parse as a cache node and a client of one tier (the same store, source, and the same
    token and password, byte for byte, mode 0600). Installing another token over a node's is refused."""
    import re as _re

    text = (ROOT / "docs" / "deploying.md").read_text()
    block = next(b for b in _re.findall(r"```sh\n(.*?)```", text, flags=_re.S) if b.startswith("# 1. the cluster's secrets"))
    made, rest = block.split("# 2.", 1)
    cache_step, gpu_step = ("# 2." + rest).split("# 3.", 1)
    work = tmp_path / "work"
    work.mkdir()
    (work / "deploy").symlink_to(ROOT / "deploy")
    (work / "README.md").symlink_to(ROOT / "README.md")
    etcs = {"cache": tmp_path / "cache-etc", "gpu": tmp_path / "gpu-etc"}
    for step, etc in ((made, None), (cache_step, etcs["cache"]), ("# 3." + gpu_step, etcs["gpu"])):
        env = dict(os.environ, **({"EPOCHFS_ETC": str(etc)} if etc else {}))
        r = subprocess.run(["bash", "-euo", "pipefail", "-c", step], cwd=work, capture_output=True, text=True,
                           timeout=60, env=env)
        assert r.returncode == 0, (step, r.stderr)
    for secret in ("redis-password", "peer-token"):
        for etc in etcs.values():
            assert oct((etc / secret).stat().st_mode & 0o777) == "0o600"
        assert (etcs["cache"] / secret).read_bytes() == (etcs["gpu"] / secret).read_bytes() == (
            work / "secrets" / secret).read_bytes()  # made once, the same on both machines
    etc = etcs["cache"]
    serve = config_from(build_parser().parse_args(["serve", "--config", str(etc / "serve-imagenet.toml")]),
                        serving=True)
    mount = parse_mount(["mount", "--config", str(etcs["gpu"] / "imagenet.toml")])
    assert serve.serving and serve.peer_listen == "10.0.1.5:9570" and mount.peer_role == "client"
    assert str(mount.mountpoint) == "/mnt/imagenet"
    for key in ("meta", "endpoint_url", "source"):
        assert getattr(serve, key) == getattr(mount, key), key
    for key in ("meta_password_file", "peer_token_file"):
        assert Path(getattr(serve, key)).read_bytes() == Path(getattr(mount, key)).read_bytes(), key
    # a node that holds another token keeps it and says so: the operator decides which is the cluster's
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "peer-token").write_text("another-token\n")
    r = subprocess.run(["bash", str(ROOT / "deploy" / "install.sh"), "--config-only", "--secrets", str(tmp_path / "other"),
                        "imagenet"], capture_output=True, text=True, timeout=60, env=dict(os.environ, EPOCHFS_ETC=str(etc)))
    assert r.returncode == 1 and "exists and differs" in r.stderr, r.stderr
    assert (etc / "peer-token").read_bytes() == (work / "secrets" / "peer-token").read_bytes()
    assert str(serve.peer_token_file).startswith(str(etc)) and serve.meta == "redis://epochfs@10.0.0.9:6379/0"
