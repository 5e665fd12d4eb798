"""Copy a local directory into a bucket of an S3 endpoint, making the bucket if it has none: the step
between a new endpoint (``python -m epochfs.dev.servers``) and a first mount, with what the checkout
already installs (boto3), no other client needed::

    python -m epochfs.dev.put ./my-dataset s3://bucket/ds/ --endpoint-url http://127.0.0.1:PORT

Credentials come from the standard AWS chain (the environment, ~/.aws), as the mount's do."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m epochfs.dev.put", description=__doc__.split("::")[0].strip())
    parser.add_argument("directory", metavar="DIR", help="the local directory whose files are copied")
    parser.add_argument("target", metavar="s3://BUCKET[/PREFIX]", help="where they go (keys: PREFIX/relative path)")
    parser.add_argument("--endpoint-url", metavar="URL", help="the S3 endpoint (default: AWS's)")
    parser.add_argument("--threads", type=int, default=16, metavar="N", help="uploads at once (default: %(default)s)")
    args = parser.parse_args(argv)
    if not args.target.startswith("s3://") or not args.target[5:].split("/")[0]:
        parser.error(f"{args.target}: give s3://BUCKET[/PREFIX]")
    bucket, _, prefix = args.target[5:].partition("/")
    prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
    root = Path(args.directory)
    if not root.is_dir():
        print(f"epochfs.dev.put: {root}: not a directory", file=sys.stderr)
        return 2
    from epochfs.dev.servers import PutFailed, put_directory

    try:
        count, total = put_directory(root, bucket, prefix, args.endpoint_url, threads=args.threads)
    except PutFailed as exc:
        print(f"epochfs.dev.put: {exc}", file=sys.stderr)
        return 1
    print(f"copied {count} files ({total / 2**20:.1f} MiB) to s3://{bucket}/{prefix}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
