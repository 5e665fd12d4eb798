"""Write-back against its hostile cases, through real mounts: names at the limits of S3's key range, a
writer that forks or dups its descriptor, writes that fail (a full cache, a full disk), two local users
on one shared mount (ownership, modes, the sticky bit, a quota), a private file through upload, relist
and remount, and an unmount or a crash in the middle of a multipart upload."""

from __future__ import annotations

import errno
import os
import random
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from .conftest import requires_fuse
from .faultproxy import Fault, FaultProxy
from .helpers import EPOCHFS, as_user, write_private
from .test_writeback import body, daemon_pid, keys_of, sync

pytestmark = requires_fuse

MiB = 1 << 20
NOBODY = 65534


def as_nobody(*cmd: str, umask: str = "022") -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", "nobody", "--", "sh", "-c", f'umask {umask}; exec "$@"', "sh", *cmd],
                          capture_output=True, text=True, timeout=60, errors="replace")


@pytest.fixture
def shared_dir(request):
    """A directory other users can traverse (pytest's own tmp dirs are private to root)."""
    base = Path(tempfile.mkdtemp(prefix="epochfs-wb-shared-"))
    os.chmod(base, 0o755)
    request.addfinalizer(lambda: shutil.rmtree(base, ignore_errors=True))
    return base


def shared_mount(mount_factory, shared_dir: Path, source: str, *args: str, name: str = "m"):
    m = mount_factory(source, "--writeback", "--allow-other", *args, cache_dir=shared_dir / f"cache-{name}",
                      name=f"unused-{name}")
    m.mountpoint = shared_dir / name
    m.mountpoint.mkdir(exist_ok=True)
    return m


def kill_daemon(m, open_fds: tuple[int, ...] = ()) -> None:
    """kill -9 the daemon, clear its dead mount, and close what the writers still hold open on it."""
    os.kill(daemon_pid(m), signal.SIGKILL)
    time.sleep(0.5)
    subprocess.run(["fusermount3", "-uz", str(m.mountpoint)], capture_output=True)
    for fd in open_fds:
        try:
            os.close(fd)
        except OSError:
            pass


# -- names at the limits -------------------------------------------------------------------------------


def test_names_past_lmdbs_key_limit_upload_delete_and_survive_a_restart(s3_client, fresh_bucket, mount_factory):
    source = f"s3://{fresh_bucket}/ckpt"
    long_key = "c" * 255 + "/" + "d" * 255 + "/" + "e" * 8  # 520 bytes, already in the bucket
    s3_client.put_object(Bucket=fresh_bucket, Key=f"ckpt/{long_key}", Body=b"old")
    m = mount_factory(source, "--writeback", name="mnt")
    m.start()
    d = m.path("a" * 255)
    d.mkdir()
    (d / ("b" * 252)).write_bytes(b"x\n")  # a 508-byte key; its parts are 255 and 252 bytes
    (d / ("é" * 127)).write_bytes(b"y\n")  # 254 bytes of two-byte characters: 510 with the directory
    assert sync(m).returncode == 0
    os.unlink(m.path(long_key))
    assert sync(m).returncode == 0
    keys = keys_of(s3_client, fresh_bucket)
    assert keys == {f"ckpt/{'a' * 255}/{'b' * 252}": 2, f"ckpt/{'a' * 255}/{'é' * 127}": 2}
    assert m.status()["writeback"]["pending_files"] == 0  # (the daemon answers: it did not die)
    m.stop()
    again = mount_factory(source, "--writeback", name="mnt")
    again.start()
    assert (again.path("a" * 255) / ("b" * 252)).read_bytes() == b"x\n"
    assert not again.path(long_key).exists()
    assert sync(again).returncode == 0


# -- when is a file done -----------------------------------------------------------------------------------


def test_a_writer_that_forked_or_dupd_is_not_done_until_its_last_close(s3_client, fresh_bucket, mount_factory):
    source = f"s3://{fresh_bucket}/ckpt"
    m = mount_factory(source, "--writeback", name="mnt")
    m.start()
    half = random.Random(1).randbytes(8 * MiB)
    whole = {}
    fds = {}
    for name in ("forked.pt", "dupd.pt", "finished.pt"):
        fd = os.open(m.path(name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, half)
        if name == "dupd.pt":
            os.close(os.dup(fd))  # a FLUSH for this description
        else:
            pid = os.fork()
            if pid == 0:  # the child (a DataLoader worker, subprocess.run) closes everything and exits
                os._exit(0)
            os.waitpid(pid, 0)
        fds[name] = fd
    time.sleep(3.0)  # past the settle time: none of them may upload while its writer still writes
    assert keys_of(s3_client, fresh_bucket) == {}
    rest = random.Random(2).randbytes(3 * MiB + 5)
    os.write(fds["finished.pt"], rest)
    os.close(fds["finished.pt"])
    whole["finished.pt"] = half + rest
    assert sync(m, str(m.path("finished.pt"))).returncode == 0
    assert body(s3_client, fresh_bucket, "ckpt/finished.pt") == whole["finished.pt"]
    for name in ("forked.pt", "dupd.pt"):
        os.write(fds[name], rest[:1000])  # still writing when the daemon dies
    kill_daemon(m, (fds["forked.pt"], fds["dupd.pt"]))
    again = mount_factory(source, "--writeback", name="mnt")
    again.start()
    assert sync(again).returncode == 0
    assert keys_of(s3_client, fresh_bucket) == {"ckpt/finished.pt": len(whole["finished.pt"])}
    assert "dropping 'forked.pt'" in again.log() and "dropping 'dupd.pt'" in again.log()


def test_a_file_whose_write_failed_is_never_uploaded_and_sync_says_so(s3, s3_client, fresh_bucket, mount_factory):
    source = f"s3://{fresh_bucket}/ckpt"
    proxy = FaultProxy(s3.port).start()
    try:
        m = mount_factory(source, "--writeback", "--endpoint-url", proxy.endpoint, "--cache-size", "8M",
                          "--backend-attempts", "1", name="mnt")
        m.start()
        proxy.set(Fault("error500", rate=1.0, methods=("PUT", "POST"), ranged_only=False))  # nothing drains
        m.path("first.pt").write_bytes(b"f" * (5 * MiB))
        with pytest.raises(OSError) as exc:  # torch.save raises; its file is cut short
            m.path("second.pt").write_bytes(b"s" * (5 * MiB))
        assert exc.value.errno == errno.ENOSPC
        size = os.stat(m.path("second.pt")).st_size
        assert 0 <= size < 5 * MiB and m.path("second.pt").read_bytes() == b"s" * size  # its size is its data
        proxy.set(None)
        result = sync(m, timeout=60)
        assert result.returncode == 1, result.stderr
        assert "second.pt" in result.stderr and "not uploaded" in result.stderr and "first.pt" not in result.stderr
        assert keys_of(s3_client, fresh_bucket) == {"ckpt/first.pt": 5 * MiB}
        m.stop()
        again = mount_factory(source, "--writeback", name="mnt")  # the journal remembers it failed
        again.start()
        time.sleep(2.0)
        assert sync(again, "--timeout", "10").returncode == 1
        assert keys_of(s3_client, fresh_bucket) == {"ckpt/first.pt": 5 * MiB}
        again.path("second.pt").write_bytes(b"t" * MiB)  # written again from the start: a new file
        assert sync(again).returncode == 0
        assert body(s3_client, fresh_bucket, "ckpt/second.pt") == b"t" * MiB
    finally:
        proxy.stop()


def test_a_full_cache_disk_is_enospc_and_the_file_is_its_data(s3_client, fresh_bucket, mount_factory, tmp_path):
    disk = tmp_path / "small"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24M", "tmpfs", str(disk)], check=True)
    try:
        m = mount_factory(f"s3://{fresh_bucket}/ckpt", "--writeback", "--cache-size", "1G",
                          "--free-space-ratio", "0", cache_dir=disk / "cache", name="mnt")
        m.start()
        with pytest.raises(OSError) as exc:
            with open(m.path("big.pt"), "wb") as f:
                for _ in range(40):
                    f.write(b"b" * MiB)
        assert exc.value.errno == errno.ENOSPC, (exc.value, m.log()[-3000:])
        size = os.stat(m.path("big.pt")).st_size
        assert m.path("big.pt").read_bytes() == b"b" * size
        os.unlink(m.path("big.pt"))
        m.path("small.pt").write_bytes(b"fits")
        assert sync(m).returncode == 0
        assert keys_of(s3_client, fresh_bucket) == {"ckpt/small.pt": 4}
        m.stop()
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# -- two users on one mount ------------------------------------------------------------------------------


def test_a_private_file_stays_private_through_upload_relist_and_remount(s3_client, fresh_bucket, mount_factory,
                                                                        shared_dir):
    source = f"s3://{fresh_bucket}/ckpt"
    m = shared_mount(mount_factory, shared_dir, source, "--dir-mode", "1777")
    m.start()
    write_private(m.path("private.pt"), b"secret\n")
    assert "Permission denied" in as_nobody("cat", str(m.path("private.pt"))).stderr
    assert sync(m).returncode == 0
    head = s3_client.head_object(Bucket=fresh_bucket, Key="ckpt/private.pt")
    assert head["Metadata"] == {"epochfs-mode": "0600", "epochfs-uid": "0", "epochfs-gid": "0"}

    def private() -> None:
        st = os.stat(m.path("private.pt"))
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, 0)
        denied = as_nobody("cat", str(m.path("private.pt")))
        assert denied.returncode != 0 and "Permission denied" in denied.stderr
        assert m.path("private.pt").read_bytes() == b"secret\n"

    private()
    m.stop()
    for extra in ((), ("--refresh",)):  # this node's snapshot, then the bucket listed again
        m = shared_mount(mount_factory, shared_dir, source, "--dir-mode", "1777", *extra)
        m.start()
        private()
        m.stop()



def test_a_private_checkpoint_stays_private_on_every_fresh_mount_of_the_bucket(s3_client, fresh_bucket,
                                                                                mount_factory, shared_dir):
    """Owners and modes live in the bucket (attribute records), so a mount on another node, read-only or
    write-back, that lists the bucket afresh presents a private file and directory as written: another
    user cannot read them. The records are epochfs's own: hidden from the mount, and no writer can make
    a name under them."""
    source = f"s3://{fresh_bucket}/ckpt"
    m = shared_mount(mount_factory, shared_dir, source, "--dir-mode", "1777")
    m.start()
    mine = m.path("mine")
    assert as_nobody("mkdir", "-m", "700", str(mine)).returncode == 0
    assert as_nobody("sh", "-c", f"echo nobody-secret > {mine}/ckpt.pt", umask="077").returncode == 0
    write_private(m.path("root.pt"), b"root-secret\n")
    m.path("public.pt").write_bytes(b"for everyone\n")
    for name in (".epochfs", ".epochfs/attrs/f-0.777.0.0"):
        with pytest.raises(OSError) as refused:
            m.path(name).write_bytes(b"x")
        # (.epochfs is the mount's control file, a regular file written by nobody: nothing is under it)
        assert refused.value.errno in (errno.EPERM, errno.ENOENT, errno.ENOTDIR), name
    assert m.path(".epochfs").stat().st_size == 0 and ".epochfs" not in os.listdir(m.mountpoint)
    assert sync(m).returncode == 0
    records = [k for k in keys_of(s3_client, fresh_bucket, "ckpt/.epochfs/attrs/")]
    assert len(records) == 4, records  # three files and the directory made here
    m.stop()
    for i, extra in enumerate([(), ("--writeback",)]):
        fresh = mount_factory(source, "--allow-other", *extra, cache_dir=shared_dir / f"fresh{i}", name=f"unused-f{i}")
        fresh.mountpoint = shared_dir / f"fresh{i}-mnt"
        fresh.mountpoint.mkdir()
        with fresh:
            assert sorted(os.listdir(fresh.mountpoint)) == ["mine", "public.pt", "root.pt"]  # no .epochfs
            st = os.stat(fresh.path("mine"))
            assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o700, NOBODY)
            st = os.stat(fresh.path("mine") / "ckpt.pt")
            assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, NOBODY)
            st = os.stat(fresh.path("root.pt"))
            assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o600, 0)
            assert stat.S_IMODE(os.stat(fresh.path("public.pt")).st_mode) == 0o644
            assert as_nobody("cat", str(fresh.path("mine") / "ckpt.pt")).stdout == "nobody-secret\n"
            for user, path in (("nobody", "root.pt"), ("daemon", "mine/ckpt.pt"), ("daemon", "root.pt")):
                denied = as_user(user, "cat", str(fresh.path(path)))
                assert denied.returncode != 0 and "Permission denied" in denied.stderr, (user, path, denied)
            assert as_user("daemon", "cat", str(fresh.path("public.pt"))).stdout == "for everyone\n"


def test_names_the_backend_cannot_store_are_refused_when_made(s3_client, fresh_bucket, mount_factory):
    """S3 stores 1,024 bytes of key: a file, a directory or a rename whose key would be longer is
    ENAMETOOLONG at once (never accepted and retried for ever); a backslash, which SeaweedFS stores
    under another key, is EINVAL; and an upload confirms the key it wrote."""
    source = f"s3://{fresh_bucket}/ckpt"
    m = mount_factory(source, "--writeback")
    with m:
        deep = m.path("/".join(["d" * 250] * 4))
        deep.mkdir(parents=True)
        ok = deep / ("n" * (1024 - len("ckpt/") - 4 * 251))  # exactly 1,024 bytes of key
        ok.write_bytes(b"fits")
        for name, code in ((deep / ("n" * (1025 - len("ckpt/") - 4 * 251)), errno.ENAMETOOLONG),
                           (m.path("back\\slash.pt"), errno.EINVAL)):
            with pytest.raises(OSError) as refused:
                name.write_bytes(b"x")
            assert refused.value.errno == code, name
        with pytest.raises(OSError) as refused:
            (deep / ("e" * 20)).mkdir()
        assert refused.value.errno == errno.ENAMETOOLONG
        short = m.path("s")
        short.mkdir()
        (short / ("f" * 200)).write_bytes(b"x")
        m.path("t" * 250).mkdir()
        (m.path("t" * 250) / ("u" * 250)).mkdir()
        (m.path("t" * 250) / ("u" * 250) / ("v" * 250)).write_bytes(b"y")
        with pytest.raises(OSError) as refused:  # moved under a long name, a file inside would not fit
            os.rename(m.path("t" * 250), deep / "w")
        assert refused.value.errno == errno.ENAMETOOLONG
        assert sync(m).returncode == 0
        keys = keys_of(s3_client, fresh_bucket, "ckpt/d")
        assert f"ckpt/{ok.relative_to(m.mountpoint)}" in keys


def test_users_own_what_they_make_the_sticky_bit_holds_and_a_quota_bounds_them(s3_client, fresh_bucket,
                                                                               mount_factory, shared_dir):
    source = f"s3://{fresh_bucket}/ckpt"
    args = ("--dir-mode", "1777", "--writeback-user-quota", "2M")
    m = shared_mount(mount_factory, shared_dir, source, *args)
    m.start()
    assert stat.S_IMODE(os.stat(m.mountpoint).st_mode) == 0o1777
    m.path("root.pt").write_bytes(b"root's")
    mine = m.path("mine")
    assert as_nobody("mkdir", str(mine)).returncode == 0
    st = os.stat(mine)
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o755, NOBODY, st.st_gid)
    assert as_nobody("sh", "-c", f"echo hi > {mine}/a.pt").returncode == 0
    # the sticky bit: another user's file in a shared directory can be neither removed nor replaced
    for cmd in (["rm", "-f", str(m.path("root.pt"))], ["mv", "-f", f"{mine}/a.pt", str(m.path("root.pt"))]):
        denied = as_nobody(*cmd)
        assert denied.returncode != 0 and "not permitted" in denied.stderr, denied
    assert m.path("root.pt").read_bytes() == b"root's" and (mine / "a.pt").exists()
    # the owner may chmod; nobody else may, nor give a directory away
    assert as_nobody("chmod", "700", str(mine)).returncode == 0
    assert stat.S_IMODE(os.stat(mine).st_mode) == 0o700
    assert as_nobody("chown", "0", str(mine)).returncode != 0
    os.chmod(mine, 0o750)  # root may
    os.chmod(mine, 0o700)
    # a quota: one user cannot fill the cache for everyone
    full = as_nobody("sh", "-c", f"head -c 3145728 /dev/zero > {mine}/big.pt")
    assert full.returncode != 0 and "quota" in full.stderr.lower(), full
    m.path("roots.pt").write_bytes(b"r" * (3 * MiB // 2))  # each user has a quota of their own
    as_nobody("rm", "-f", f"{mine}/big.pt")
    assert sync(m).returncode == 0
    m.stop()
    again = shared_mount(mount_factory, shared_dir, source, *args)  # what was made here keeps its owner
    again.start()
    st = os.stat(again.path("mine"))
    assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o700, NOBODY)
    assert os.stat(again.path("mine") / "a.pt").st_uid == NOBODY
    denied = as_nobody("rm", "-f", str(again.path("root.pt")))
    assert denied.returncode != 0 and again.path("root.pt").exists()
    again.stop()


DCP_SAVE = """
import sys, torch, torch.distributed.checkpoint as dcp
try:
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=sys.argv[1])
except BaseException as exc:  # (DCP wraps the writer's OSError in its CheckpointException, a BaseException)
    print("refused:", "Permission denied" in str(exc), flush=True)
    sys.exit(3)
state = {"w": torch.zeros(6)}
dcp.load(state, checkpoint_id=sys.argv[1])
assert torch.equal(state["w"], torch.arange(6.0)), state
print("saved and loaded", flush=True)
"""


def job_user() -> str:
    """A second local user (besides nobody) for the job: made once, a system user with no home."""
    import pwd

    try:
        pwd.getpwnam("epochfs-job")
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "epochfs-job"],
                       check=True)
    return "epochfs-job"


def test_a_checkpoint_directory_squatted_by_another_user_is_refused_not_written(s3_client, fresh_bucket,
                                                                                mount_factory, shared_dir):
    """The documented multi-user set-up (--allow-other --dir-mode 1777) and a job saving with torch DCP to
    /mnt/ckpt/step-1000: another user makes step-1000/ first (mode 0777), to rename their own .metadata
    over the job's afterwards (a pickle the job's dcp.load would run). A user never writes in another
    user's directory: the job's save is refused (EACCES), loudly, instead of landing where its owner can
    swap it; in a directory of the job's own, the save and the load work."""
    torch = pytest.importorskip("torch")  # noqa: F841 - (the job's own interpreter imports it)
    python = "/usr/bin/python3"
    site = Path(__file__).resolve().parents[1] / ".venv" / "lib" / "python3.11" / "site-packages"
    if not os.path.exists(python) or not site.is_dir():
        pytest.skip("needs /usr/bin/python3 and the virtualenv's site-packages for the job's user")
    job = job_user()
    m = shared_mount(mount_factory, shared_dir, f"s3://{fresh_bucket}/ckpt", "--dir-mode", "1777")
    m.start()
    squat = m.path("step-1000")
    assert as_nobody("sh", "-c", f"mkdir {squat} && chmod 777 {squat}").returncode == 0
    script = shared_dir / "dcp_save.py"
    script.write_text(DCP_SAVE)
    script.chmod(0o644)
    env = f"PYTHONPATH={Path(__file__).resolve().parents[1] / 'src'}:{site}"

    def save(where: Path) -> subprocess.CompletedProcess[str]:
        return as_user(job, "env", env, "HOME=/tmp", python, str(script), str(where))

    r = save(squat)
    assert r.returncode == 3 and "refused: True" in r.stdout, (r.stdout, r.stderr[-2000:])
    assert list(squat.iterdir()) == []  # nothing of the job's where another user could swap it
    own = m.path("job")
    assert as_user(job, "mkdir", str(own)).returncode == 0
    r = save(own / "step-1000")
    assert r.returncode == 0 and "saved and loaded" in r.stdout, (r.stdout, r.stderr[-2000:])
    # a file in a directory of the job's own cannot be replaced by the other user, sticky bit or not
    metadata = own / "step-1000" / ".metadata"
    assert metadata.exists() and os.stat(metadata).st_uid == os.stat(own).st_uid
    planted = as_nobody("sh", "-c", f"echo evil > {squat}/.metadata && mv -f {squat}/.metadata {metadata}")
    assert planted.returncode != 0 and metadata.read_bytes() != b"evil\n"
    m.stop()


# -- stopping in the middle of an upload ------------------------------------------------------------------


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # (a zombie has exited)
    except OSError:
        return False


def multipart_uploads(s3_client, bucket: str) -> list[str]:
    return [u["Key"] for u in s3_client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


def test_umount_during_a_large_upload_stops_at_once_and_the_next_mount_finishes_it(
        s3_client, fresh_bucket, mount_factory):
    source = f"s3://{fresh_bucket}/ckpt"
    m = mount_factory(source, "--writeback", "--upload-bandwidth", "4M", name="mnt")
    m.start()
    data = random.Random(3).randbytes(80 * MiB)  # over the multipart threshold
    m.path("big.pt").write_bytes(data)
    deadline = time.monotonic() + 30
    while not multipart_uploads(s3_client, fresh_bucket):
        assert time.monotonic() < deadline, m.log()[-2000:]
        time.sleep(0.2)
    pid = daemon_pid(m)
    start = time.monotonic()
    result = subprocess.run([*EPOCHFS, "umount", str(m.mountpoint)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "1 written file (80.0 MiB) was not uploaded yet" in result.stderr and "upload when it is mounted again" in result.stderr
    assert time.monotonic() - start < 15
    assert not alive(pid)  # the daemon is gone: no second one races it for the cache directory
    assert "ckpt/big.pt" not in keys_of(s3_client, fresh_bucket)
    again = mount_factory(source, "--writeback", name="mnt")
    again.start()
    assert sync(again, timeout=180).returncode == 0
    assert body(s3_client, fresh_bucket, "ckpt/big.pt") == data
    assert multipart_uploads(s3_client, fresh_bucket) == []


def test_a_multipart_upload_cut_off_by_a_crash_is_aborted_at_the_next_start(s3_client, fresh_bucket,
                                                                            mount_factory):
    source = f"s3://{fresh_bucket}/ckpt"
    m = mount_factory(source, "--writeback", "--upload-bandwidth", "4M", name="mnt")
    m.start()
    m.path("big.pt").write_bytes(random.Random(4).randbytes(70 * MiB))
    deadline = time.monotonic() + 30
    while not multipart_uploads(s3_client, fresh_bucket):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(0.5)  # (the journal has its id: it is written as the upload is created)
    kill_daemon(m)
    assert multipart_uploads(s3_client, fresh_bucket) == ["ckpt/big.pt"]
    again = mount_factory(source, "--writeback", name="mnt")
    again.start()
    os.unlink(again.path("big.pt"))  # not wanted any more: nothing of it may stay billed
    deadline = time.monotonic() + 30
    # (the daemon says so once the abort is answered and its journal entry dropped: a moment after the
    # endpoint stops listing the upload)
    while multipart_uploads(s3_client, fresh_bucket) or \
            "aborted an unfinished multipart upload of big.pt" not in again.log():
        assert time.monotonic() < deadline, again.log()[-3000:]
        time.sleep(0.2)
    assert sync(again).returncode == 0 and keys_of(s3_client, fresh_bucket) == {}


@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in (1, 2, 3))])
def test_seeded_crash_points_with_forked_and_dupd_writers(s3_client, fresh_bucket, mount_factory, seed):
    """Writers that fork, dup and close descriptors in a seeded order; the daemon is killed at a seeded
    point. After a remount and a sync, every object in the backend is a file that was whole and released
    before the kill, byte-exact, and every such file is there."""
    rng = random.Random(seed)
    source = f"s3://{fresh_bucket}/ckpt"
    m = mount_factory(source, "--writeback", name="mnt")
    m.start()
    names = [f"f{i}.pt" for i in range(6)]
    content = {n: rng.randbytes(rng.choice([1, 4095, 70_001, MiB + 3])) for n in names}
    fds: dict[str, list[int]] = {}
    written: dict[str, int] = {}
    released: set[str] = set()
    steps = []
    for n in names:
        steps += [("open", n)] + [("write", n)] * rng.randrange(1, 4) + \
            [rng.choice([("fork", n), ("dup", n), ("nothing", n)]), ("write", n), ("close", n)]
    rng.shuffle(steps)
    # keep each file's steps in order (open first, close last) while interleaving the files
    order: dict[str, list[tuple[str, str]]] = {}
    for n in names:
        order[n] = [s for s in steps if s[1] == n]
        order[n].sort(key=lambda s: {"open": 0, "close": 2}.get(s[0], 1))
    plan = []
    while any(order.values()):
        n = rng.choice([k for k, v in order.items() if v])
        plan.append(order[n].pop(0))
    kill_at = rng.randrange(len(plan) // 2, len(plan) + 1)
    for i, (op, n) in enumerate(plan[:kill_at]):
        if op == "open":
            fds[n] = [os.open(m.path(n), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)]
            written[n] = 0
        elif op == "write":
            data = content[n]
            end = written[n] + max(1, len(data) // 3) if i % 2 else len(data)
            os.pwrite(fds[n][0], data[written[n]:end], written[n])
            written[n] = min(len(data), end)
        elif op == "fork":
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)
        elif op == "dup":
            os.close(os.dup(fds[n][0]))
        elif op == "close":
            if written[n] < len(content[n]):  # (finish it: a close ends a whole file here)
                os.pwrite(fds[n][0], content[n][written[n]:], written[n])
                written[n] = len(content[n])
            os.close(fds[n].pop())
            released.add(n)
    time.sleep(rng.choice([0.0, 0.3, 1.5]))
    kill_daemon(m, tuple(fd for left in fds.values() for fd in left))
    again = mount_factory(source, "--writeback", name="mnt")
    again.start()
    assert sync(again).returncode == 0
    keys = keys_of(s3_client, fresh_bucket)
    assert set(keys) == {f"ckpt/{n}" for n in released}, (released, keys, plan[:kill_at])
    for n in released:
        assert body(s3_client, fresh_bucket, f"ckpt/{n}") == content[n]


def test_a_dot_epochfs_component_is_reserved_at_any_depth(s3_client, fresh_bucket, mount_factory, shared_dir):
    """A user of a write-back mount of a parent prefix cannot make the records of a mount under it
    (``ds/.epochfs/attrs/f-<hash>.666.<uid>.<gid>`` would present a dataset file as theirs, mode 0666, on
    every mount of ``ds``), nor any name with a ``.epochfs`` component; one planted in the bucket at any
    depth is hidden from every mount, the parent's and the child's."""
    from epochfs.backend.attrs import record_key

    s3_client.put_object(Bucket=fresh_bucket, Key="ds/data.bin", Body=b"the dataset's\n")
    s3_client.put_object(Bucket=fresh_bucket, Key="ds/deep/.epochfs/planted", Body=b"x")
    s3_client.put_object(Bucket=fresh_bucket, Key="ds/deep/kept.bin", Body=b"k")
    parent = shared_mount(mount_factory, shared_dir, f"s3://{fresh_bucket}", "--dir-mode", "1777", name="parent")
    parent.start()
    try:
        forged = f"ds/{record_key('data.bin', 0o666, NOBODY, NOBODY)}"
        for name in (forged, "ds/.epochfs", "ds/deep/.epochfs/x", ".epochfs"):
            made = as_nobody("sh", "-c", f"mkdir -p {parent.path(name).parent} && echo x > {parent.path(name)}")
            assert made.returncode != 0, name
        assert as_nobody("mkdir", str(parent.path("ds") / "sub" / ".epochfs")).returncode != 0
        assert ".epochfs" not in os.listdir(parent.path("ds") / "deep")
        assert sync(parent).returncode == 0
    finally:
        parent.stop()
    assert not keys_of(s3_client, fresh_bucket, "ds/.epochfs/")  # nothing made under the child's records
    child = mount_factory(f"s3://{fresh_bucket}/ds", "--allow-other", cache_dir=shared_dir / "child",
                          name="unused-child")
    child.mountpoint = shared_dir / "child-mnt"
    child.mountpoint.mkdir()
    with child:
        assert sorted(os.listdir(child.mountpoint / "deep")) == ["kept.bin"]
        st = os.stat(child.path("data.bin"))
        assert (stat.S_IMODE(st.st_mode), st.st_uid) == (0o444, 0)  # the defaults: no record of nobody's
        assert as_nobody("sh", "-c", f"echo y > {child.path('data.bin')}").returncode != 0


def test_the_reserved_name_is_found_in_any_key():
    """A fuzz loop over keys: a key is reserved exactly when one of its components is ``.epochfs``, and
    the namespace never holds one (whatever else the key is)."""
    import random

    from epochfs.backend.attrs import reserved
    from epochfs.core.records import ObjectInfo
    from epochfs.meta.index import build

    rng = random.Random(9)
    parts = [".epochfs", ".epochfs.", "epochfs", "..epochfs", ".EPOCHFS", "a", "", ".", "..", "x.epochfs", "attrs"]
    keys = ["/".join(rng.choice(parts) for _ in range(rng.randrange(1, 5))) + rng.choice(["", "/"])
            for _ in range(4000)]
    for key in keys:
        assert reserved(key) == (".epochfs" in key.split("/")), key
    ns = build([ObjectInfo(k, 1, 0, '"e"') for k in keys])
    held = [f.obj.key for f in ns.files()]
    assert held and not any(".epochfs" in k.split("/") for k in held)


def test_sync_answers_a_name_in_another_users_private_directory_as_a_missing_one(s3_client, fresh_bucket,
                                                                                   mount_factory, shared_dir):
    """``sync`` names nothing its caller could not reach: a real file in another user's 0700 directory
    and a name that is nowhere get the same answer (and exit code), so guesses pick out nothing."""
    python = "/usr/bin/python3"
    site = Path(__file__).resolve().parents[1] / ".venv" / "lib" / "python3.11" / "site-packages"
    if not os.path.exists(python) or not site.is_dir():
        pytest.skip("needs /usr/bin/python3 and the virtualenv's site-packages for the other user")
    m = shared_mount(mount_factory, shared_dir, f"s3://{fresh_bucket}/ckpt", "--dir-mode", "1777")
    m.start()
    home = m.path("home-secB")
    home.mkdir()
    os.chmod(home, 0o700)
    (home / "project-falcon.pt").write_bytes(b"plans")
    env = f"PYTHONPATH={Path(__file__).resolve().parents[1] / 'src'}:{site}"

    def sync_as_nobody(path: Path) -> subprocess.CompletedProcess[str]:
        return as_nobody("env", env, "HOME=/tmp", python, "-m", "epochfs", "sync", str(m.mountpoint), str(path),
                         "--timeout", "5")

    real, guess = sync_as_nobody(home / "project-falcon.pt"), sync_as_nobody(home / "project-x.pt")
    assert real.returncode == guess.returncode != 0, (real, guess)
    assert real.stdout + real.stderr == (guess.stdout + guess.stderr).replace("project-x", "project-falcon")
    assert "not in the mount" in real.stderr
    mine = m.path("shared-nobody.pt")  # (what the caller may reach is answered as before)
    assert as_nobody("sh", "-c", f"echo hi > {mine}").returncode == 0
    assert sync_as_nobody(mine).returncode == 0
    assert sync(m).returncode == 0
    m.stop()


def _readme_block(after: str, lang: str) -> str:
    """The first ``lang`` code block after the line containing ``after`` in docs/writeback.md (where the
    README sends a checkpoint's user)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "writeback.md").read_text()
    rest = text[text.index(after):]
    start = rest.index(f"```{lang}\n") + len(lang) + 4
    return rest[start:rest.index("```", start)]


def test_the_shared_checkpoint_recipe_works_as_pasted_by_a_jobs_user(s3_client, fresh_bucket,
                                                                             mount_factory, shared_dir):
    """The documented write-back mount for a node whose jobs run as other users, its flags as pasted, and
    its checkpoint snippet run by such a user: the user makes its own directory under the mount's root
    (presented 1777) and saves there (with torch DCP where torch is installed, else the same path with a
    plain file), and the checkpoint reaches the backend. With --dir-mode given, that mode rules."""
    (line,) = [ln for ln in _readme_block("mount it for them", "sh").splitlines() if ln.startswith("epochfs mount")]
    argv = shlex.split(line)
    assert argv[:4] == ["epochfs", "mount", "s3://ckpt-bucket/run-42", "/mnt/ckpt"], argv
    flags = argv[4:]
    i = flags.index("--cache-dir")
    del flags[i:i + 2]  # (the test's own cache directory)
    assert "--allow-other" in flags and "--writeback" in flags
    m = shared_mount(mount_factory, shared_dir, f"s3://{fresh_bucket}/run-42", *[f for f in flags
                                                                               if f not in ("--writeback", "--allow-other")])
    m.start()
    assert stat.S_IMODE(os.stat(m.mountpoint).st_mode) == 0o1777
    snippet = _readme_block("PyTorch's distributed checkpointing needs nothing but the path", "python")
    snippet = snippet.replace("/mnt/ckpt", str(m.mountpoint))
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    if not have_torch:  # (the save itself is torch's; the path and the sync are what the recipe decides)
        snippet = snippet.replace("torch.distributed.checkpoint.save(state_dict, checkpoint_id=f\"{run}/step-1000\")",
                                  "open(f\"{run}/step-1000\", \"wb\").write(b\"x\" * 1000)")
    script = shared_dir / "recipe.py"
    script.write_text("import getpass, os, epochfs\n"
                      + ("import torch, torch.distributed.checkpoint\nstate_dict = {'w': torch.arange(6.0)}\n"
                         if have_torch else "")
                      + snippet + "\nprint('durable', run)\n")
    script.chmod(0o644)
    job = job_user()
    site = Path(__file__).resolve().parents[1] / ".venv" / "lib" / "python3.11" / "site-packages"
    env = f"PYTHONPATH={Path(__file__).resolve().parents[1] / 'src'}:{site}"
    r = as_user(job, "env", env, "HOME=/tmp", "/usr/bin/python3", str(script))
    assert r.returncode == 0 and "durable" in r.stdout, (r.stdout, r.stderr[-2000:])
    keys = keys_of(s3_client, fresh_bucket)
    assert any(k.startswith(f"run-42/{job}/resnet50/step-1000") for k in keys), keys
    # Another user may not remove or write in the job's directory.
    denied = as_nobody("rm", "-rf", str(m.path(job)))
    assert denied.returncode != 0 and m.path(job).exists()
    m.stop()
    explicit = shared_mount(mount_factory, shared_dir, f"s3://{fresh_bucket}/run-42", "--dir-mode", "0755", name="e")
    explicit.start()
    assert stat.S_IMODE(os.stat(explicit.mountpoint).st_mode) == 0o755
    explicit.stop()
