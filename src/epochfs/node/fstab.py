"""The mount(8) helper, installed as ``/sbin/mount.epochfs``, so that ``/etc/fstab`` can name epochfs:

    s3://bucket/prefix  /mnt/data  epochfs  config=/etc/epochfs/data.toml,_netdev,nofail  0 0
    s3://bucket/prefix  /mnt/data  epochfs  cache_dir=/nvme/epochfs,cache_size=500G,endpoint_url=http://10.0.0.5:9000,_netdev  0 0

mount(8) runs ``mount.epochfs SOURCE MOUNTPOINT [-sfnv] -o OPTIONS``. Each option ``key=value`` becomes
``--key value`` of ``epochfs mount`` (underscores or dashes), a bare ``key`` becomes ``--key``; options
that only mean something to mount(8) or systemd (``defaults``, ``ro``, ``noauto``, ``nofail``,
``_netdev``, ``x-systemd.*``, ...) are dropped. The command returns once the mount answers.
"""

from __future__ import annotations

import sys

from epochfs import cli

IGNORED = {
    "defaults", "rw", "ro", "auto", "noauto", "user", "users", "nouser", "owner", "group", "nofail", "_netdev",
    "exec", "noexec", "suid", "nosuid", "dev", "nodev", "async", "sync", "atime", "noatime", "relatime",
    "strictatime", "lazytime", "nodiratime", "diratime", "loud", "silent",
}


def translate(options: str) -> list[str]:
    """``-o`` options of mount(8) -> flags of ``epochfs mount``."""
    args: list[str] = []
    for opt in options.split(","):
        opt = opt.strip()
        if not opt or opt in IGNORED or opt.startswith(("x-", "comment=", "helper=")):
            continue
        key, sep, value = opt.partition("=")
        flag = "--" + key.replace("_", "-")
        args += [flag, value] if sep else [flag]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    positional: list[str] = []
    options: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-o" and i + 1 < len(argv):
            options.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("-o") and len(arg) > 2:
            options.append(arg[2:])
        elif arg in ("-s", "-f", "-n", "-v", "-r", "-w") or arg.startswith("-t"):
            pass  # sloppy, fake, no-mtab, verbose, ro/rw: the options say whether it writes (writeback=...)
        else:
            positional.append(arg)
        i += 1
    if len(positional) != 2:
        print("usage: mount.epochfs SOURCE MOUNTPOINT [-o OPTIONS]", file=sys.stderr)
        return 2
    flags = [flag for opts in options for flag in translate(opts)]
    return cli.main(["mount", positional[0], positional[1], *flags])


if __name__ == "__main__":
    raise SystemExit(main())
