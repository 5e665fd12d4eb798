"""One rank of a PyTorch job that saves or loads a checkpoint with torch.distributed.checkpoint (a gloo
process group over 127.0.0.1; RANK, WORLD_SIZE, MASTER_PORT from the environment):

    python dcp_rank.py save|async_save|load CHECKPOINT_DIR STEP

Every rank holds a replicated model and an optimizer-like state of its own; ``load`` fills zeroed
tensors and exits 0 only if every tensor equals what ``save`` wrote. ``save`` prints "saved" once the
call returned (for async_save, once its future did)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def state(rank: int, step: int, *, zero: bool = False) -> dict:
    g = torch.Generator().manual_seed(step)
    model = {f"layer{i}.weight": torch.randn(384, 384, generator=g) for i in range(6)}
    g = torch.Generator().manual_seed(1000 * step + rank)
    own = {f"rank{rank}.momentum": torch.randn(1024, 257, generator=g)}  # (odd sizes: block boundaries)
    s = {"model": model, "optim": own, "step": torch.tensor(step)}
    if zero:
        s = {"model": {k: torch.zeros_like(v) for k, v in model.items()},
             "optim": {k: torch.zeros_like(v) for k, v in own.items()}, "step": torch.tensor(-1)}
    return s


def main() -> int:
    mode, path, step = sys.argv[1], sys.argv[2], int(sys.argv[3])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['MASTER_PORT']}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank = dist.get_rank()
    try:
        if mode == "save":
            dcp.save(state(rank, step), checkpoint_id=path)
        elif mode == "async_save":
            done = dcp.async_save(state(rank, step), checkpoint_id=path)
            done = getattr(done, "upload_completion", done)  # (an AsyncSaveResponse, or a Future)
            done.result()
        else:
            got = state(rank, step, zero=True)
            dcp.load(got, checkpoint_id=path)
            want = state(rank, step)
            bad = [k for part in ("model", "optim") for k in want[part]
                   if not torch.equal(got[part][k], want[part][k])]
            if bad or int(got["step"]) != step:
                print(f"rank {rank}: differs: {bad or 'step'}", file=sys.stderr)
                return 1
        dist.barrier()
        print("saved" if mode != "load" else "loaded", flush=True)
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    raise SystemExit(main())
