"""``epochfs doctor``: is the training job waiting for storage, and if so, why, what is already in place,
what to change, and what it costs. Pure: it reads two ``status`` replies taken ``seconds`` apart (the
jobs' own reports, see :mod:`epochfs.watch`, and the mount's state) and returns a verdict with its
findings.

The rules are the operators' ones:

- a job that waits for data more than half of its step time, or whose GPU is under 50% busy while it
  waits at least a fifth, is ``storage-bound``; one that waits under a fifth is ``compute-bound``; in
  between, ``balanced``; without reports, ``no-job-data``;
- the first epoch (the cold read) and the later ones (read from the cache) are judged apart, as each
  report names its epoch; the verdict is the later epochs' once there are any, else the first's (a job
  whose reports name no epoch is judged over the daemon's window, the last 10 minutes);
- for a storage-bound or balanced job, each cause the mount's state shows is a finding: what shows it,
  and the fix, as a command or flag to paste, only where it is not in place already, most helpful first;
- what an epoch and a day cost: the backend's requests and bytes of each epoch (the mount's counters
  where the job's epochs began) and the GPU hours spent waiting, at the operator's prices
  (:mod:`epochfs.doctor.cost`).

The package: :mod:`.views` (the job's phases, the mount's state), :mod:`.findings` (causes and fixes),
:mod:`.advice` (the commands and sizes advised), :mod:`.report` (the answer, its cost, its words). It
imports the cache's accounting, the cost model and the text helpers; nothing of the daemon.
"""

from __future__ import annotations

from epochfs.doctor.advice import serve_command, share_fix, size_flag, warmup_command
from epochfs.doctor.findings import ORDER, findings_of
from epochfs.doctor.report import compare, diagnose, render
from epochfs.doctor.views import job_view, mount_view, verdict_of

__all__ = ["ORDER", "compare", "diagnose", "findings_of", "job_view", "mount_view", "render", "serve_command",
           "share_fix", "size_flag", "verdict_of", "warmup_command"]
