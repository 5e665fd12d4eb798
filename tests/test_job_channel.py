"""The training job's channel where jobs really run: as a user who is not root, in a pod-like namespace
that sees only the dataset's mount (its own mount and network namespaces, the node's cache directory and
/run hidden under a tmpfs), the job hands its order over through the mount and reads its epoch from the
cache; a second user's hostile requests are refused with a clear error and change nothing; random frames
from a user who is not root never stop the daemon."""

from __future__ import annotations

import glob
import grp
import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from epochfs.control.client import request
from epochfs.control.inmount import MountChannel
from epochfs.dev.sample import SampleFile, upload

from .conftest import requires_fuse
from .helpers import read_all

pytestmark = requires_fuse
KiB = 1 << 10
REPO = Path(__file__).resolve().parents[1]
PYTHON = "/usr/bin/python3"


def _needs() -> str | None:
    if os.geteuid() != 0:
        return "needs root (users, namespaces)"
    for tool in ("unshare", "setpriv", "useradd", "groupadd"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if not os.path.exists(PYTHON):
        return f"needs {PYTHON} (the job's own interpreter)"
    probe = subprocess.run([PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True,
                           text=True)
    if probe.stdout.strip() != f"{sys.version_info[0]}.{sys.version_info[1]}":
        return f"{PYTHON} is Python {probe.stdout.strip()}, the virtualenv's is {sys.version_info[:2]}"
    return None


pytestmark = [requires_fuse, pytest.mark.skipif(_needs() is not None, reason=_needs() or "")]


def user(name: str, *, groups: tuple[str, ...] = ()) -> tuple[int, int, tuple[int, ...]]:
    """A real local user of the node (made once: a system user with no home and no shell)."""
    for g in groups:
        try:
            grp.getgrnam(g)
        except KeyError:
            subprocess.run(["groupadd", "--system", g], check=True)
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
        pw = pwd.getpwnam(name)
    return pw.pw_uid, pw.pw_gid, tuple(grp.getgrnam(g).gr_gid for g in groups)


def in_pod(script: str, mount: Path, who: tuple[int, int, tuple[int, ...]], *, hide: list[Path],
           args: tuple[str, ...] = (), timeout: float = 120, files: dict[str, str] | None = None,
           command: str | None = None, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Python ``script`` run as ``who`` (uid, gid, supplementary groups) in new mount and network
    namespaces that see the dataset's ``mount`` at ``<pod>/data`` (its first argument) and this
    checkout's code, with ``hide`` and /run under an empty tmpfs: what a pod sees. ``files`` are put in
    the pod's directory (executable under ``bin/``, on the PATH, where ``epochfs`` is the command);
    ``command`` (a shell line) runs instead of the script."""
    pod = Path(tempfile.mkdtemp(prefix="epochfs-pod-", dir="/tmp"))
    try:
        os.chmod(pod, 0o755)
        (pod / "data").mkdir()
        (pod / "code").mkdir()
        (pod / "bin").mkdir(mode=0o755)
        site = glob.glob(str(REPO / ".venv" / "lib" / "python3*" / "site-packages"))[0].replace(str(REPO), f"{pod}/code")
        more = {"job.py": textwrap.dedent(script), "bin/epochfs": f'#!/bin/sh\nexec {PYTHON} -m epochfs "$@"\n',
                **(files or {})}
        for name, text in more.items():
            (pod / name).write_text(text)
            os.chmod(pod / name, 0o755 if name.startswith("bin/") else 0o644)
        uid, gid, groups = who
        extra = " ".join(f"{k}={shlex.quote(v.replace('POD', str(pod)))}" for k, v in (env or {}).items())
        run = command.replace("POD", str(pod)) if command else (
            f"{PYTHON} {pod}/job.py {pod}/data " + " ".join(shlex.quote(a) for a in args))
        steps = [f"mount --bind {shlex.quote(str(mount))} {pod}/data", f"mount --bind {shlex.quote(str(REPO))} {pod}/code",
                 *[f"mount -t tmpfs -o size=1m none {shlex.quote(str(h))}" for h in hide],
                 "mount -t tmpfs -o size=1m none /run",
                 f"exec setpriv --reuid {uid} --regid {gid} "
                 + (f"--groups {','.join(map(str, groups))}" if groups else "--clear-groups")
                 + f" env -i PATH={pod}/bin:/usr/bin:/bin HOME=/ PYTHONPATH={pod}/code/src:{site} {extra} {run}"]
        return subprocess.run(["unshare", "--mount", "--net", "--propagation", "private", "sh", "-ec",
                               "\n".join(steps)], capture_output=True, text=True, timeout=timeout)
    finally:
        shutil.rmtree(pod, ignore_errors=True)


def answer(done: subprocess.CompletedProcess[str]) -> dict:
    assert done.returncode == 0, f"the job failed:\n{done.stdout}\n{done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


JOB = """
import json, os, sys, time
from epochfs import Client
from epochfs.prefetch.manifest import epoch_order
from epochfs.watch import watch

mnt = sys.argv[1]
assert not os.path.exists("/run/epochfs"), "the pod sees the node's runtime directory"
samples = sorted(os.path.join(d, n) for d, _, names in os.walk(mnt) for n in names)
client = Client(mnt)
before = client.status()
reply = client.prefetch(samples, seed=11, epoch=0)
order = epoch_order(samples, seed=11, epoch=0)
deadline = time.monotonic() + 60
while client.status()["prefetch"]["fetched_bytes"] < sum(os.path.getsize(p) for p in samples):
    assert time.monotonic() < deadline, client.status()["prefetch"]
    time.sleep(0.1)
read = 0
for data in watch((open(p, "rb", buffering=0).read() for p in order), mnt, job="pod-job"):
    read += len(data)
after = client.status()
hit = after["cache"]["hit_bytes"] - before["cache"]["hit_bytes"]
miss = after["cache"]["miss_bytes"] - before["cache"]["miss_bytes"]
print(json.dumps({"reply": reply, "read": read, "hit": hit, "miss": miss, "uid": os.getuid(),
                  "socket_seen": os.path.exists(os.getxattr(mnt, "user.epochfs.control").decode())}))
"""


def test_a_job_in_a_pod_as_another_user_hands_over_its_order_and_reads_its_epoch_from_the_cache(
        s3_client, fresh_bucket, mount_factory, tmp_path):
    files = [SampleFile(f"train/c{i % 4}/{i:03d}.jpg", 40 * KiB + 13 * i) for i in range(48)]
    upload(s3_client, fresh_bucket, "", files)
    job_user = user("epochfs-job")
    with mount_factory(f"s3://{fresh_bucket}", "--allow-other", "--eviction", "manifest", "--block-size", "256K",
                       "--cache-size", "64M") as m:
        got = answer(in_pod(JOB, m.mountpoint, job_user, hide=[tmp_path]))
        assert got["uid"] == job_user[0] and got["socket_seen"] is False  # (through the mount, not the socket)
        assert got["reply"]["files"] == len(files) and got["read"] == sum(f.size for f in files)
        assert got["hit"] / (got["hit"] + got["miss"]) >= 0.9, got
        status = m.status()
        (job,) = [j for j in status["jobs"] if j["job"] == "pod-job"]  # the job's view, reported through the mount
        assert job["uid"] == job_user[0] and job["handed_over"] is True and job["steps"] == len(files)
        cli = in_pod("import runpy, sys; sys.argv = ['epochfs', 'status', sys.argv[1], '--json']; "
                     "runpy.run_module('epochfs', run_name='__main__')", m.mountpoint, job_user, hide=[tmp_path])
        assert cli.returncode == 0, cli.stderr
        assert json.loads(cli.stdout)["snapshot"]["files"] == len(files)


HOSTILE = """
import json, os, sys, fcntl
from epochfs import Client
from epochfs.control import frames
from epochfs.core.errors import EpochfsError

mnt, job_id = sys.argv[1], int(sys.argv[2])
client = Client(mnt)
out = {}

def attempt(name, fn):
    try:
        out[name] = ["ok", fn()]
    except EpochfsError as exc:
        out[name] = [type(exc).__name__, str(exc)]

pub = [f"pub/{i}.bin" for i in range(10)]
attempt("replace", lambda: client.hand_over(pub, epoch=0, replace=True))
attempt("merge", lambda: client.hand_over(pub, epoch=0, rank=1))
attempt("flood", lambda: client.hand_over(pub, epoch=1))
attempt("unreadable", lambda: client.hand_over(["priv/secret.bin"]))
attempt("missing", lambda: client.hand_over(["priv/nothing.bin"]))
attempt("locked", lambda: client.hand_over(["pub/locked.bin"]))
attempt("warm-locked", lambda: client.warmup(["pub/locked.bin"]))
attempt("cancel", lambda: client.cancel(job_id))
attempt("peek", lambda: client._request("job", id=job_id))
attempt("peek-missing", lambda: client._request("job", id=job_id + 1000))
attempt("forge", lambda: client._request("report", job="resnet", rank=1, steps=5, data_wait=1.0, compute=1.0))
attempt("refresh", lambda: client._request("refresh"))
attempt("publish", lambda: client._request("publish_manifest", name="x", text="pub/0.bin\\n"))
attempt("status", lambda: client.status()["snapshot"]["files"])
fd = os.open(os.path.join(mnt, frames.NAME), os.O_RDONLY)
held = []
for i in range(20):  # sessions opened and never finished
    buf = frames.frame_in(bytes([i]) * 16, frames.SEND, b'{"op": "status"')
    fcntl.ioctl(fd, frames.COMMAND, buf, True)
    held.append(frames.parse_out(buf))
for i in range(20):
    fcntl.ioctl(fd, frames.COMMAND, frames.frame_in(bytes([i]) * 16, frames.CLOSE), True)
os.close(fd)
out["held"] = [[s, d.decode()] for s, d in held]
print(json.dumps(out))
"""

FUZZ = """
import json, os, random, sys, fcntl
from epochfs.control import frames

mnt = sys.argv[1]
rng = random.Random(int(sys.argv[2]))
fd = os.open(os.path.join(mnt, frames.NAME), os.O_RDONLY)
lines = [b"\\xff\\xfe\\n", b"[" * 5000 + b"\\n", b'{"op": "prefetch", "entries": [[1, "pub/0.bin"]]}\\n',
         b'{"op": "prefetch", "entries": [], "follow": true}\\n[[1, 2]]\\n', b'{"op": "job", "id": -1}\\n',
         b'{"op": "report", "job": "resnet", "rank": 0, "steps": 1, "data_wait": 0, "compute": 0}\\n']
states = {}
for i in range(400):
    sid = bytes([rng.randrange(6)]) * 16
    kind = rng.choice([frames.SEND, frames.SEND, frames.RECV, frames.CLOSE, 0, 9])
    data = rng.choice(lines + [bytes(rng.getrandbits(8) for _ in range(rng.randrange(0, 300)))])
    buf = bytearray(frames.FRAME)
    buf[:len(frames.frame_in(sid, 1))] = frames.frame_in(sid, 1)
    buf[16] = kind
    n = min(len(data), frames.PAYLOAD)
    buf[20:24] = (n if rng.random() < 0.9 else rng.getrandbits(32)).to_bytes(4, "little")
    buf[24:24 + n] = data[:n]
    fcntl.ioctl(fd, frames.COMMAND, buf, True)
    state = frames.parse_out(buf)[0]
    states[state] = states.get(state, 0) + 1
print(json.dumps(states))
"""


def test_another_user_can_neither_touch_a_jobs_order_warmup_nor_view_and_learns_nothing_it_may_not_read(
        mount_factory, tmp_path):
    src = tmp_path / "src"
    (src / "pub").mkdir(parents=True)
    (src / "priv").mkdir(mode=0o700)
    for i in range(10):
        (src / "pub" / f"{i}.bin").write_bytes(bytes([i]) * (4 * KiB + i))
    (src / "pub" / "locked.bin").write_bytes(b"L" * 100)
    os.chmod(src / "pub" / "locked.bin", 0o600)
    (src / "priv" / "secret.bin").write_bytes(b"S" * 100)
    os.chmod(src / "priv" / "secret.bin", 0o644)
    os.chmod(tmp_path, 0o755)
    os.chmod(src, 0o755)
    owner, other, operator = user("epochfs-job"), user("epochfs-other"), user("epochfs-ops",
                                                                             groups=("epochfs-operators",))
    # One user may queue 16 blocks of orders (each file here is one block) and warm 20 KiB at once.
    with mount_factory(f"file://{src}", "--allow-other", "--control-group", "epochfs-operators",
                       "--user-share", str(16 / (8 << 20)), "--cache-size", str(int(20 * KiB * (8 << 20) / 16))) as m:
        mine = answer(in_pod("""
            import json, sys
            from epochfs import Client
            c = Client(sys.argv[1])
            pub = [f"pub/{i}.bin" for i in range(10)]
            handed = c.hand_over(pub, epoch=0, rank=0)
            job = c.warmup(["pub/0.bin"], wait=False)
            c._request("report", job="resnet", rank=0, steps=7, data_wait=1.0, compute=2.0)
            # Every session this user may hold, open: a request waits its turn (busy, asked again), never fails.
            import fcntl, os, threading, time
            from epochfs.control import frames
            fd = os.open(os.path.join(sys.argv[1], frames.NAME), os.O_RDONLY)
            held = [bytes([i]) * 16 for i in range(int(sys.argv[2]))]
            for sid in held:
                fcntl.ioctl(fd, frames.COMMAND, frames.frame_in(sid, frames.SEND, b'{"op": '), True)
            waited = {}
            t = threading.Thread(target=lambda: waited.update(files=c.status()["snapshot"]["files"]))
            t.start()
            time.sleep(1.0)
            busy_meanwhile = t.is_alive()
            for sid in held:
                fcntl.ioctl(fd, frames.COMMAND, frames.frame_in(sid, frames.CLOSE), True)
            t.join(30)
            print(json.dumps({"handed": handed, "job": job["id"], "waited": waited, "busy_meanwhile": busy_meanwhile}))
        """, m.mountpoint, owner, hide=[tmp_path / "cache"], args=(str(MountChannel.PER_UID),)))
        assert mine["handed"]["files"] == 10
        assert mine["busy_meanwhile"] is True and mine["waited"] == {"files": 12}  # it waited its turn
        plan_before = m.status()["prefetch"]
        got = answer(in_pod(HOSTILE, m.mountpoint, other, hide=[tmp_path / "cache"], args=(str(mine["job"]),)))
        refused = {k: v for k, v in got.items() if k not in ("held", "merge", "status")}
        for name, (kind, message) in refused.items():
            assert kind in ("NotPermitted", "ConfigError"), (name, kind, message)
        assert "another user's order" in got["replace"][1]
        assert got["merge"][0] == "ok" and got["merge"][1]["merged"] is False  # queued after it, never interleaved
        assert "--user-share" in got["flood"][1]
        # An unreadable name is refused exactly as a missing one: nothing is learnt about it.
        assert got["unreadable"][1].replace("secret", "X") == got["missing"][1].replace("nothing", "X")
        assert "not in the snapshot or not readable by you" in got["locked"][1] and got["warm-locked"][0] == "ConfigError"
        # Another user's warmup (its files, sizes, errors naming keys) is answered as one that does not exist,
        # to a cancel as to a look at it.
        assert got["cancel"] == [got["peek"][0], f"no warmup job {mine['job']}"], got["cancel"]
        assert got["peek"][0] == got["peek-missing"][0] != "ok"
        assert got["peek"][1].replace(str(mine["job"]), "N") == got["peek-missing"][1].replace(
            str(mine["job"] + 1000), "N")
        assert "reported by another user" in got["forge"][1]
        assert "--control-group" in got["refresh"][1] and "--control-group" in got["publish"][1]
        assert got["status"] == ["ok", 12]  # reading state is anyone's
        busy = [d for s, d in got["held"] if s != 1]
        assert len(busy) == 20 - MountChannel.PER_UID and all("busy" in d for d in busy)  # (a user's share of them)
        status = m.status()
        assert status["prefetch"]["files"] == 20 and status["prefetch"]["position"] == plan_before["position"]
        (resnet,) = [j for j in status["jobs"] if j["job"] == "resnet"]
        assert resnet["uid"] == owner[0] and resnet["steps"] == 7  # the forged report changed nothing
        ops = answer(in_pod("""
            import json, sys
            from epochfs import Client
            print(json.dumps(Client(sys.argv[1])._request("refresh")))
        """, m.mountpoint, operator, hide=[tmp_path / "cache"]))
        assert isinstance(ops, dict)  # a member of --control-group may (its groups read from the kernel's record)
        fuzz = answer(in_pod(FUZZ, m.mountpoint, other, hide=[tmp_path / "cache"], args=("5",), timeout=300))
        assert fuzz.get("6", 0) > 0 and fuzz.get("1", 0) > 0, fuzz  # refused frames and taken ones
        assert request(m.mountpoint, "status")["pid"] > 0  # alive and answering
        for i in range(10):
            assert read_all(m.path(f"pub/{i}.bin")) == bytes([i]) * (4 * KiB + i)
        assert "Traceback" not in m.log(), "an input reached an unexpected error path"


UNREACHABLE = """
import json, sys
from epochfs import Client
from epochfs.control.client import Unreachable, tell_once

mnt = sys.argv[1]
try:
    Client(mnt).status()
except Unreachable as exc:
    said = [tell_once("the sampler", mnt, exc), tell_once("the sampler", mnt, exc)]
    print(json.dumps({"error": str(exc), "said": said}))
"""


def test_a_job_that_cannot_reach_the_daemon_is_told_why_and_the_fix_once(mount_factory, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"a" * 1000)
    with mount_factory(f"file://{src}") as m:  # (no --allow-other: the kernel lets only root and the owner in)
        done = in_pod(UNREACHABLE, m.mountpoint, user("epochfs-job"), hide=[tmp_path / "cache"])
        got = answer(done)
        assert "--allow-other" in got["error"] and got["said"] == [True, False]
        assert done.stderr.count("cannot reach the daemon") == 1 and "--allow-other" in done.stderr


TRAIN = """
import json, os, sys
from epochfs import Client
from epochfs.prefetch.manifest import epoch_order
from epochfs.watch import watch

data = sys.argv[sys.argv.index("--data") + 1]
samples = sorted(os.path.join(d, n) for d, _, names in os.walk(data) for n in names)
reply = Client(data).prefetch(samples, seed=1, epoch=0)
read = sum(len(b) for b in watch((open(p, "rb").read() for p in epoch_order(samples, seed=1, epoch=0)), data,
                                 job=os.environ["SLURM_JOB_NAME"]))
print(json.dumps({"handed": reply["files"], "read": read}))
"""


def test_the_slurm_example_job_hands_over_its_order_as_the_submitting_user(mount_factory, tmp_path):
    """deploy/slurm/train.sbatch as Slurm runs it on a node (as the user who submitted it; srun stood in
    for by the command itself): its status check, the hand-over of its training script, its doctor."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"{i}.bin").write_bytes(bytes([i]) * (3 * KiB))
    os.chmod(tmp_path, 0o755)
    os.chmod(src, 0o755)
    with mount_factory(f"file://{src}", "--allow-other") as m:
        done = in_pod("", m.mountpoint, user("epochfs-job"), hide=[tmp_path / "cache"], timeout=180,
                      files={"bin/srun": '#!/bin/sh\nexec "$@"\n', "bin/python": f'#!/bin/sh\nexec {PYTHON} "$@"\n',
                             "train.py": TRAIN, "train.sbatch": (REPO / "deploy" / "slurm" / "train.sbatch").read_text()},
                      command="sh -c 'cd POD && exec bash POD/train.sbatch'",
                      env={"EPOCHFS_DATA": "POD/data", "SLURM_JOB_NAME": "resnet50"})
        assert done.returncode == 0, done.stdout + done.stderr
        got = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][0])
        assert got == {"handed": 12, "read": 12 * 3 * KiB}
        assert "resnet50" in done.stdout  # the doctor answered the job as its user
        (job,) = [j for j in m.status()["jobs"] if j["job"] == "resnet50"]
        assert job["handed_over"] is True and job["uid"] == user("epochfs-job")[0]
