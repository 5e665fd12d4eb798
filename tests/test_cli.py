"""Careless input through the real command line: every one gets a clear message (no traceback), an exit
code that says whose fault it is (2: the input, 1: the world), and changes nothing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from epochfs.dev.sample import SampleFile, upload

from .conftest import requires_fuse
from .helpers import EPOCHFS, Mount, read_all

pytestmark = requires_fuse
KiB, MiB = 1 << 10, 1 << 20


def epochfs(*args: str, env=None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([*EPOCHFS, *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    return r


@pytest.fixture
def tmpfs(tmp_path):
    mounted = []

    def make(name: str, *options: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=16m", *options)), "tmpfs", str(path)],
                       check=True)
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def test_a_cache_dir_on_a_read_only_file_system(tmpfs, tmp_path, s3, sample_bucket):
    ro = tmpfs("ro", "ro")
    (tmp_path / "mnt").mkdir()
    r = epochfs("mount", f"s3://{sample_bucket}/data", str(tmp_path / "mnt"), "--endpoint-url", s3.endpoint,
                "--cache-dir", str(ro / "cache"), env=s3.env())
    assert r.returncode == 2 and "Read-only file system" in r.stderr and str(ro / "cache") in r.stderr
    rw = tmpfs("was-rw")
    (rw / "cache").mkdir(mode=0o700)
    subprocess.run(["mount", "-o", "remount,ro", str(rw)], check=True)  # the cache exists; the disk went read-only
    r = epochfs("mount", f"s3://{sample_bucket}/data", str(tmp_path / "mnt"), "--endpoint-url", s3.endpoint,
                "--cache-dir", str(rw / "cache"), env=s3.env())
    assert r.returncode == 2 and "Read-only file system" in r.stderr
    assert not os.path.ismount(tmp_path / "mnt")


def test_a_cache_dir_on_a_full_file_system_is_named_with_what_to_do(tmpfs, tmp_path, s3, sample_bucket):
    full = tmpfs("full")
    with open(full / "filler", "wb") as f:  # (until the file system says it is full)
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
    (tmp_path / "mnt").mkdir()
    r = epochfs("mount", f"s3://{sample_bucket}/data", str(tmp_path / "mnt"), "--endpoint-url", s3.endpoint,
                "--cache-dir", str(full / "cache"), env=s3.env())
    assert r.returncode == 2, r.stderr
    assert str(full / "cache") in r.stderr and "No space left on device" in r.stderr, r.stderr
    assert "file system is full" in r.stderr and "[Errno" not in r.stderr, r.stderr
    assert not os.path.ismount(tmp_path / "mnt")


def test_a_cache_directory_reused_for_another_source_says_what_it_still_holds(tmp_path, s3, s3_client, fresh_bucket):
    upload(s3_client, fresh_bucket, "", [SampleFile("a/x.bin", 5000), SampleFile("b/y.bin", 5000)])
    cache = tmp_path / "cache"

    def mount(prefix: str) -> str:
        m = Mount(f"s3://{fresh_bucket}/{prefix}", tmp_path / "mnt", cache, s3.env(), "--endpoint-url", s3.endpoint,
                  "--metrics-addr", "off")
        r = m.start()
        try:
            read_all(m.path("x.bin" if prefix == "a" else "y.bin"))
        finally:
            m.stop()
        return r.stderr

    assert "served" not in mount("a")
    said = mount("b")
    assert f"served s3://{fresh_bucket}/a/ before" in said and "remove the directory" in said, said
    assert f"served s3://{fresh_bucket}/a/ before" in mount("b")  # (said at each mount, not only the first)
    assert f"served s3://{fresh_bucket}/b/" in mount("a")


def test_a_non_empty_mount_point_is_refused_unless_asked(tmp_path, s3, sample_bucket):
    m = Mount(f"s3://{sample_bucket}/data", tmp_path / "mnt", tmp_path / "cache", s3.env(), "--endpoint-url",
              s3.endpoint, "--metrics-addr", "off")
    (m.mountpoint / "precious.txt").write_text("mine")
    r = m.start(expect_ok=False)
    assert r.returncode == 2 and "is not empty (1 entries)" in r.stderr and "--allow-non-empty" in r.stderr
    assert not os.path.ismount(m.mountpoint) and not m.cache_dir.exists(), "a failed first mount left its cache"
    m.start("--allow-non-empty")
    try:
        assert "precious.txt" not in os.listdir(m.mountpoint)
    finally:
        m.stop()
    assert (m.mountpoint / "precious.txt").read_text() == "mine"


def test_an_empty_prefix_warns_and_is_not_remembered(s3, s3_client, fresh_bucket, tmp_path):
    m = Mount(f"s3://{fresh_bucket}/typo", tmp_path / "mnt", tmp_path / "cache", s3.env(), "--endpoint-url",
              s3.endpoint, "--metrics-addr", "off")
    r = m.start()
    assert "lists no objects" in r.stderr and "Check the bucket and prefix" in r.stderr
    text = epochfs("status", str(m.mountpoint)).stdout
    assert "0 files" in text and "taken" in text and " ago" in text
    assert epochfs("status", str(m.mountpoint), "--json").stdout.count('"age_seconds"') == 1
    m.stop()
    upload(s3_client, fresh_bucket, "typo/", [SampleFile("a.bin", 1000)])  # the data arrives
    r = m.start()
    try:
        assert "lists no objects" not in r.stderr
        assert read_all(m.path("a.bin")) == SampleFile("a.bin", 1000).content()
    finally:
        m.stop()


def _interruptible(args: list[str], **kwargs) -> subprocess.Popen:
    """A command started with SIGINT at its default, as a terminal's foreground job has it, however the
    suite was started: run as a background job of a non-interactive shell, the suite ignores SIGINT, and
    a signal ignored is ignored by the commands it starts too (a Ctrl-C the command rightly never sees)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a handler: reset to the default at exec)
    try:
        return subprocess.Popen(args, **kwargs)
    finally:
        signal.signal(signal.SIGINT, before)


def test_warmup_into_a_small_cache_fails_and_ctrl_c_cancels_it_in_the_daemon(s3, s3_client, fresh_bucket, tmp_path):
    files = [SampleFile(f"w/{i}.bin", 256 * KiB) for i in range(16)]
    upload(s3_client, fresh_bucket, "", files)
    small = Mount(f"s3://{fresh_bucket}", tmp_path / "small", tmp_path / "c-small", s3.env(), "--endpoint-url",
                  s3.endpoint, "--metrics-addr", "off", "--block-size", "256K", "--cache-size", "1M",
                  "--free-space-ratio", "0")
    with small:
        r = epochfs("warmup", str(small.mountpoint), str(small.path("w")))
        assert r.returncode == 1 and "the cache is full" in r.stderr and "not cached" in r.stderr
    slow = Mount(f"s3://{fresh_bucket}", tmp_path / "slow", tmp_path / "c-slow", s3.env(), "--endpoint-url",
                 s3.endpoint, "--metrics-addr", "off", "--block-size", "256K", "--prefetch-bandwidth", "512K")
    with slow:
        started = time.monotonic()
        proc = _interruptible([*EPOCHFS, "warmup", str(slow.mountpoint), str(slow.path("w"))],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(2.5)  # --prefetch-bandwidth caps warmup: 4 MiB take about 8 s
        exited = proc.poll()
        signalled = time.monotonic() - started
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 130 and "warmup cancelled" in err, (
            f"exit {proc.returncode} (already exited before the signal: {exited is not None}; signalled after "
            f"{signalled:.1f} s); stdout: {out!r}; stderr: {err!r}; status: {slow.status()['cache']}")
        time.sleep(1.5)
        fetched = slow.status()["cache"]["prefetch_fetches"]
        assert 2 <= fetched <= 8, f"{fetched} blocks: the bandwidth cap was not applied"
        time.sleep(2)
        assert slow.status()["cache"]["prefetch_fetches"] == fetched, "the daemon went on fetching"


def test_messages_say_what_is_wrong_without_python_or_errno_noise(tmp_path):
    for args, expect in [
        (["mount", "s3://b", str(tmp_path), "--backend-concurrency", "lots"], "is not a whole number"),
        (["mount", "s3://b", str(tmp_path), "--cache-size", "huge"], "not a size"),
        (["prefetch", str(tmp_path), "--manifest", str(tmp_path / "nope.txt")], "No such file or directory"),
        (["status", str(tmp_path / "nope")], "nope: no such file or directory"),
        (["status", str(tmp_path)], "is not an epochfs mount"),
        (["fsck", "--cache-dir", str(tmp_path / "nope")], "not an epochfs cache directory"),
        (["mount", "s3://b", str(tmp_path), "--cach-size", "1G"], "--cach-size: did you mean --cache-size?"),
        (["status", str(tmp_path), "--jsn"], "usage: epochfs status"),  # the command's usage, not the top's
    ]:
        r = epochfs(*args)
        assert r.returncode == (1 if args[0] == "status" and "--jsn" not in args else 2), (args, r.stderr)
        assert expect in r.stderr, (args, r.stderr)
        assert "[Errno" not in r.stderr and "invalid literal" not in r.stderr, r.stderr


def test_small_things(s3, sample_bucket, sample_files, tmp_path):
    paths = tmp_path / "paths.txt"
    paths.write_text("".join(f.key + "\n" for f in sample_files[:10]))
    r = epochfs("manifest", str(paths), "--seed", "3", "--epoch", "1", "-o", "-")
    assert r.returncode == 0 and sorted(r.stdout.split()) == sorted(f.key for f in sample_files[:10])
    assert not Path("-").exists()
    r = epochfs("status", str(tmp_path), "--json")
    assert r.returncode == 1 and "not an epochfs mount" in json.loads(r.stdout)["error"]
    m = Mount(f"s3://{sample_bucket}/data", tmp_path / "mnt", tmp_path / "cache", s3.env(), "--endpoint-url",
              s3.endpoint, "--metrics-addr", "off", "--cache-size", "100T")
    r = m.start()
    assert "more than the cache file system can hold" in r.stderr
    assert "--cache-size 100.0 TiB is" in r.stderr and "bytes" not in r.stderr  # (sizes as people read them)
    pid = int(os.getxattr(m.mountpoint, "user.epochfs.pid"))
    assert (f"mounted s3://{sample_bucket}/data/ at {m.mountpoint} (daemon pid {pid}); cache {m.cache_dir}, "
            f"log {m.cache_dir / 'epochfs.log'}") in r.stderr, r.stderr  # (where its cache and its log are)
    try:
        store = m.status()["store"]  # the bound reported is the disk's, not the one asked for
        disk = os.statvfs(m.cache_dir)
        assert store["configured_bytes"] == 100 << 40
        assert store["capacity_bytes"] <= disk.f_blocks * disk.f_frsize
        assert "the disk bounds it (--cache-size 100.0 TiB)" in epochfs("status", str(m.mountpoint)).stdout
        piped = subprocess.run(f"{' '.join(EPOCHFS)} status {m.mountpoint} | head -1", shell=True,
                               capture_output=True, text=True)
        assert piped.stdout.startswith("mount") and not piped.stderr
        with open(m.path(sample_files[0].key), "rb"):
            r = epochfs("umount", str(m.mountpoint))
            assert r.returncode == 1 and "--lazy" in r.stderr
    finally:
        m.stop()
    r = epochfs("mount", "s3://no-such-bucket-anywhere/x", str(tmp_path / "mnt"), "--endpoint-url", s3.endpoint,
                "--cache-dir", str(tmp_path / "fresh-cache"), "--metrics-addr", "off", env=s3.env())
    assert r.returncode == 2 and "does not exist" in r.stderr
    assert not (tmp_path / "fresh-cache").exists(), "a failed first mount left a cache directory behind"


def test_credentials_from_a_named_profile(s3, sample_bucket, sample_files, tmp_path):
    from epochfs.dev.servers import ACCESS_KEY, SECRET_KEY

    creds = tmp_path / "credentials"
    creds.write_text(f"[training]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n")
    env = {k: v for k, v in s3.env().items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(creds), AWS_CONFIG_FILE="/nonexistent", AWS_EC2_METADATA_DISABLED="true")
    m = Mount(f"s3://{sample_bucket}/data", tmp_path / "mnt", tmp_path / "cache", env, "--endpoint-url", s3.endpoint,
              "--metrics-addr", "off")
    r = m.start("--profile", "nope", expect_ok=False)
    assert r.returncode == 2 and "--profile 'nope': no such profile" in r.stderr
    with Mount(f"s3://{sample_bucket}/data", tmp_path / "mnt", tmp_path / "cache", env, "--endpoint-url",
               s3.endpoint, "--metrics-addr", "off", "--profile", "training") as m:
        f = sample_files[3]
        assert read_all(m.path(f.key)) == f.content()



def cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:  # gone meanwhile
        return b""


@pytest.mark.mounts
def test_the_dev_server_has_help_and_stops_seaweedfs_with_it(tmp_path):
    import sys

    r = subprocess.run([sys.executable, "-m", "epochfs.dev.servers", "--help"], capture_output=True, text=True,
                       timeout=20, cwd=tmp_path)
    assert r.returncode == 0 and "DATA_DIR" in r.stdout and not (tmp_path / "--help").exists()
    data = tmp_path / "s3-data"
    proc = subprocess.Popen([sys.executable, "-m", "epochfs.dev.servers", str(data)], stdout=subprocess.PIPE, text=True)
    try:
        assert "S3 endpoint http://127.0.0.1:" in proc.stdout.readline()
        weed = [p for p in Path("/proc").iterdir() if p.name.isdigit() and f"-dir={data}".encode() in cmdline(p)]
        assert len(weed) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        deadline = time.monotonic() + 5  # SeaweedFS is gone with it, not left running
        while weed[0].exists() and "Z" not in (weed[0] / "stat").read_text().split(")")[1][:3]:
            assert time.monotonic() < deadline, "weed runs on after the dev server stopped"
            time.sleep(0.05)
    finally:
        proc.kill()


def test_paths_may_follow_options():
    """`epochfs warmup MOUNT --check images` and `epochfs cluster warmup SRC --meta URL a b`: PATHs given
    after options are PATHs (argparse alone leaves them over as unknown arguments)."""
    from epochfs.cli import build_parser, parse

    args = parse(build_parser(), ["warmup", "/mnt/data", "--check", "images", "more"])
    assert args.paths == ["images", "more"] and args.check
    args = parse(build_parser(), ["cluster", "warmup", "s3://b/p", "--meta", "redis://h/0", "--peer-token-file",
                                  "t", "a/b", "c"])
    assert args.paths == ["a/b", "c"]
    with pytest.raises(SystemExit):
        parse(build_parser(), ["warmup", "/mnt/data", "--check", "--frobnicate"])


def _parsers(parser, path=()):  # type: ignore[no-untyped-def]
    """Every parser and subparser of ``parser``, with the words that reach it."""
    import argparse as _argparse

    yield path, parser
    for action in parser._actions:
        if isinstance(action, _argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


def test_every_help_renders_as_text():
    """Each command's --help is rendered whole: no option's text is taken for a format string (a "70%"
    once printed argparse's internals) and each option has its text."""
    from epochfs.cli import build_parser

    seen = 0
    for path, parser in _parsers(build_parser()):
        text = parser.format_help()
        assert "option_strings" not in text and "%(" not in text, (path, text)
        for action in parser._actions:
            if action.option_strings and action.help is not None:
                assert action.help.strip(), (path, action.option_strings)
        seen += 1
    assert seen >= 15


def test_status_tells_a_replica_from_the_backend_and_where_reads_came_from():
    from epochfs.cli.status import format_link, format_origins, format_peer

    peer = {"requests": {"ok": 97, "unavailable": 3, "bad": 0, "declined": 0, "served": 0, "rejected": 0},
            "fallbacks": {"replica": 3, "backend": 0}, "role": "client", "me": "client", "mode": "owned",
            "replicas": 2, "members": ["198.18.0.5:9570"], "down": [], "store_reachable": True,
            "bytes_in": 400 << 20, "bytes_out": 0}
    text = "\n".join(format_peer(peer))
    assert "fell back" not in text and "3 asks failed: 3 then asked another replica, 0 the backend" in text
    assert "1 member," in text and "1 members" not in text
    s = {"reads": {"local": 100, "owner": 290, "replica": 10, "backend": 0}, "peer": peer}
    assert format_origins(s) == "what was read came from this node's cache 25%, cache nodes 72%, another replica 2%"
    s["reads"]["backend"] = 100  # (a hit fetched ahead from the backend: said, beside a hit ratio of 100%)
    assert format_origins(s).endswith("the backend 20% (fetched ahead of the readers or on demand)")
    assert format_origins({"reads": {"local": 0, "owner": 0, "replica": 0, "backend": 0}}) == ""
    assert "not known" in format_link(None, "--backend-bandwidth") and "--backend-bandwidth" in format_link(
        None, "--backend-bandwidth")
    assert format_link({"bytes_per_second": 40 << 20, "source": "interface", "detail": "eth0, speed 10 Gbit/s"},
                       "x") == "link 40.0 MiB/s (interface: eth0, speed 10 Gbit/s)"


def test_cluster_warmup_takes_the_cache_nodes_geometry_and_warns_where_told_otherwise(capsys):
    """`cluster warmup` without --replicas or --block-size takes what the cache nodes publish; told
    otherwise, it says so (a warmup at other replicas leaves blocks unheld, at another block size it
    warms blocks no member asks for)."""
    import argparse
    import json as _json

    from epochfs.cli.cluster import geometry

    stats = {a: _json.dumps({"replicas": 2, "block_size": 1 << 20}).encode() for a in ("10.0.0.1:9570", "10.0.0.2:9570")}
    args = argparse.Namespace(replicas=None, block_size=None)
    geometry(args, sorted(stats), stats)
    assert (args.replicas, args.block_size) == (2, 1 << 20) and capsys.readouterr().err == ""
    args = argparse.Namespace(replicas=1, block_size=4 << 20)
    geometry(args, sorted(stats), stats)
    err = capsys.readouterr().err
    assert "run with --replicas 2, this warmup with --replicas 1" in err and "--block-size 1048576" in err
    args = argparse.Namespace(replicas=None, block_size=None)
    geometry(args, ["10.0.0.3:9570"], {"10.0.0.3:9570": b"{not json"})  # nothing published: the defaults
    assert (args.replicas, args.block_size) == (1, 4 << 20)
    # figures out of bounds (a block of 1 byte or of 1 TiB, a million replicas) are no one's geometry
    odd = {"10.0.0.4:9570": _json.dumps({"replicas": 10**6, "block_size": 1}).encode(),
           "10.0.0.5:9570": _json.dumps({"replicas": 0, "block_size": 1 << 40}).encode()}
    args = argparse.Namespace(replicas=None, block_size=None)
    geometry(args, sorted(odd), odd)
    assert (args.replicas, args.block_size) == (1, 4 << 20)


def test_cluster_warmup_takes_its_geometry_from_the_members_that_proved_themselves(tmp_path, monkeypatch):
    """Anyone who can write the store can list members and publish figures for them: the warmup takes
    the block size and replicas only from members that proved they hold the token."""
    import argparse

    from epochfs.cli import cluster

    class Store:
        def load(self, source_id):
            return type("Snapshot", (), {"objects": []})()

        def close(self):
            pass

    real, planted = "10.0.0.1:9570", [f"10.0.0.{9 + i}:9570" for i in range(3)]  # (outnumbered by planted ones)
    stats = {real: json.dumps({"replicas": 1, "block_size": 1 << 20}).encode(),
             **{p: json.dumps({"replicas": 2, "block_size": 8 << 20}).encode() for p in planted}}
    monkeypatch.setattr(cluster, "_store", lambda args: (Store(), "s3://b/p/"))
    monkeypatch.setattr(cluster, "_members", lambda store, source: {real: "server", **dict.fromkeys(planted, "server")})
    monkeypatch.setattr(cluster, "_stats", lambda store, source, members: stats)

    class Client:
        timeout = 0.0

    monkeypatch.setattr(cluster, "_prove", lambda servers, token: (
        Client(), {real: None, **dict.fromkeys(planted, "declined")}, {real: None}))
    token = tmp_path / "token"
    token.write_text("x" * 32)
    args = argparse.Namespace(source="s3://b/p/", config=None, meta="redis://h:1/0", meta_name=None,
                              meta_password_file=None, meta_ca_file=None, peer_token_file=token, replicas=None,
                              block_size=None, concurrency=4, timeout=5.0, bandwidth=None, quiet=True, paths=[],
                              manifest=None, needs_token=True)
    assert cluster.cmd_warmup(args) == 0
    assert (args.replicas, args.block_size) == (1, 1 << 20)  # the real member's, though the planted one's is larger


def test_a_dead_endpoint_at_mount_says_its_first_request_failed(tmp_path):
    """No snapshot stored and an endpoint that does not answer: the mount fails saying the source's first
    request failed and what to check, not that it was looking for packs the user never used."""
    env = dict(os.environ, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s")
    (tmp_path / "mnt").mkdir()
    r = subprocess.run([*EPOCHFS, "mount", "s3://b/p", str(tmp_path / "mnt"), "--endpoint-url", "http://127.0.0.1:9",
                        "--cache-dir", str(tmp_path / "c"), "--metrics-addr", "off", "--metrics-targets", "off",
                        "--backend-timeout", "3"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and "the backend's first answer failed" in r.stderr and "--endpoint-url" in r.stderr
    assert "epochfs-pack.json" not in r.stderr and "packed" not in r.stderr, r.stderr  # (our probe, not theirs)


def test_the_dev_endpoint_takes_a_port_and_says_when_it_is_taken(tmp_path):
    """`python -m epochfs.dev.servers DIR --port N`: the endpoint on that port; a port another server
    holds is refused at once with what to do, before SeaweedFS is started."""
    import socket

    from epochfs.dev.servers import free_ports

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "epochfs.dev.servers", str(tmp_path / "a"), "--port", str(taken)],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and f"--port {taken}: 127.0.0.1:{taken} is taken" in r.stderr, r.stderr
    assert "choose another --port" in r.stderr
    (port,) = free_ports(1)
    proc = subprocess.Popen([sys.executable, "-m", "epochfs.dev.servers", str(tmp_path / "b"), "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert f"S3 endpoint http://127.0.0.1:{port} " in line, (line, proc.stderr.read() if proc.poll() else "")
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@requires_fuse
def test_the_readmes_local_endpoint_recipe_runs_as_pasted(tmp_path):
    """The README's block for trying epochfs on a local endpoint, line by line as pasted (the port, the
    directories and the mount point replaced by the test's own): no tool the checkout does not install."""
    import socket

    root = Path(__file__).resolve().parents[1]
    text = (root / "README.md").read_text()
    block = text[text.index("No S3 endpoint at hand to try it on?"):]
    block = block[block.index("```sh\n") + 6:]
    block = block[:block.index("```")]
    assert "aws " not in block
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = tmp_path / "my-dataset"
    (data / "sub").mkdir(parents=True)
    (data / "a.bin").write_bytes(b"a" * 5000)
    (data / "sub" / "b.bin").write_bytes(b"b" * 7000)
    (tmp_path / "mnt").mkdir()
    script = (block.replace("8333", str(port)).replace("/tmp/s3", str(tmp_path / "s3"))
              .replace("./my-dataset", str(data)).replace("/mnt/data", str(tmp_path / "mnt")))
    script = script.replace("epochfs mount s3://bucket/ds", f"epochfs mount --cache-dir {tmp_path / 'cache'} "
                            "--metrics-addr off s3://bucket/ds")
    script = ("set -e\ntrap 'kill %1 2>/dev/null; wait' EXIT\n" + script
              + f"cat {tmp_path / 'mnt'}/sub/b.bin > {tmp_path / 'read'}\n.venv/bin/epochfs umount {tmp_path / 'mnt'}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") or k == "AWS_CA_BUNDLE"}
    r = subprocess.run(["bash", "-c", script], cwd=root, capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "read").read_bytes() == b"b" * 7000
    assert "accepts any credentials" in r.stdout and "copied 2 files" in r.stderr, r.stdout + r.stderr
