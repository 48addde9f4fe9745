"""A throwaway single-node SLURM cluster on localhost, from Debian's packages (munge, slurmctld, slurmd).

Everything lives under one directory: a fresh munge key and socket, a generated slurm.conf with this
machine's CPUs and free ports, the daemons' state, logs and PID files. `stop` ends the daemons by PID.
Clients find the cluster through SLURM_CONF (`Cluster.env`). `stop` cancels every job first, so no
job step outlives the cluster.

  python tests/launch/slurm_cluster.py DIR     # start one by hand; `kill $(cat DIR/*.pid)` stops it
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

DAEMONS = ('munged', 'slurmctld', 'slurmd')
CLIENTS = ('sbatch', 'scontrol', 'scancel', 'squeue')


def missing() -> list[str]:
  """The programs this needs that are not installed."""
  return [p for p in (*DAEMONS, *CLIENTS) if not shutil.which(p, path=os.environ['PATH'] + ':/usr/sbin:/sbin')]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


class Cluster:
  def __init__(self, root: Path):
    self.root = root
    self.conf = root / 'slurm.conf'
    self.env = {**os.environ, 'SLURM_CONF': str(self.conf)}
    self.pids: dict[str, int] = {}

  def start(self, timeout: float = 60) -> None:
    root = self.root
    for d in ('state', 'spool'):
      (root / d).mkdir(parents=True, exist_ok=True)
    key = root / 'munge.key'
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    self._run('munged', '--force', f'--key-file={key}', f'--socket={root / "munge.sock"}',
              f'--pid-file={root / "munged.pid"}', f'--log-file={root / "munged.log"}',
              f'--seed-file={root / "munge.seed"}')
    user = subprocess.run(['id', '-un'], capture_output=True, text=True).stdout.strip()
    self.conf.write_text(f'''ClusterName=lmtest
SlurmctldHost=localhost
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it starts again (default 120 s)
AuthInfo=socket={root / "munge.sock"},cred_expire=10
StateSaveLocation={root / "state"}
SlurmdSpoolDir={root / "spool"}
SlurmctldPidFile={root / "slurmctld.pid"}
SlurmdPidFile={root / "slurmd.pid"}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmctldLogFile={root / "slurmctld.log"}
SlurmdLogFile={root / "slurmd.log"}
ProctrackType=proctrack/linuxproc
# Tasks bound to the CPUs they were given, as on a cluster: a 1-task job trains on one core (unbound, XLA's threads
# spread over ~1.5 cores and slow the suite's other worker for the minutes the SLURM tests' jobs run)
TaskPlugin=task/affinity
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
KillWait=30
NodeName=localhost CPUs={os.cpu_count()} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
''')
    self._run('slurmctld', '-f', str(self.conf))
    self._run('slurmd', '-f', str(self.conf), '-N', 'localhost')
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      out = subprocess.run(['sinfo', '-h', '-o', '%T'], env=self.env, capture_output=True, text=True).stdout
      if out.strip() == 'idle':  # both daemons up, their PID files written
        self.pids = {name: int((root / f'{name}.pid').read_text().split()[0]) for name in DAEMONS}
        return
      time.sleep(0.5)
    self.pids = {name: int(f.read_text().split()[0]) for name in DAEMONS if (f := root / f'{name}.pid').exists()}
    self.stop(grace=0)
    raise RuntimeError(f'the SLURM node did not come up in {timeout:.0f} s; see {root}/slurmctld.log, slurmd.log')

  def _run(self, program: str, *args: str) -> None:
    done = subprocess.run([shutil.which(program, path=os.environ['PATH'] + ':/usr/sbin:/sbin'), *args],
                          env=self.env, capture_output=True, text=True, timeout=60)
    if done.returncode:
      raise RuntimeError(f'{program} did not start: {done.stderr.strip()}')

  def stop(self, grace: float = 60) -> None:
    """Cancels every job (waiting up to `grace` s for their steps to end), then ends the daemons by PID."""
    user = subprocess.run(['id', '-un'], capture_output=True, text=True).stdout.strip()
    subprocess.run(['scancel', f'--user={user}'], env=self.env, capture_output=True)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and subprocess.run(['squeue', '-h'], env=self.env, capture_output=True,
                                                         text=True).stdout.strip():
      time.sleep(1)
    for name in reversed(DAEMONS):
      pid = self.pids.get(name)
      if pid is None:
        continue
      for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
          os.kill(pid, sig)
        except ProcessLookupError:
          break
        end = time.monotonic() + wait
        while time.monotonic() < end and Path(f'/proc/{pid}').exists():
          time.sleep(0.2)

  def job(self, job_id: str) -> dict[str, str]:
    """`scontrol show job`'s fields (JobState, Restarts, ExitCode, ...)."""
    out = subprocess.run(['scontrol', 'show', 'job', '-o', job_id], env=self.env, capture_output=True,
                         text=True).stdout
    return dict(re.findall(r'(\w+)=(\S*)', out))

  def wait(self, job_id: str, states: set[str], timeout: float) -> dict[str, str]:
    """The job's fields once its state is one of `states`; AssertionError with them after `timeout`."""
    deadline, fields = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
      fields = self.job(job_id)
      if fields.get('JobState') in states:
        return fields
      time.sleep(1)
    raise AssertionError(f'job {job_id} not in {states} after {timeout:.0f} s: {fields}')


if __name__ == '__main__':
  cluster = Cluster(Path(sys.argv[1]).absolute())
  cluster.start()
  print(f'SLURM is up: export SLURM_CONF={cluster.conf}')
