"""Cloud TPU pods and multislice jobs through gcloud queued resources.

  python launch/tpu.py create --name NAME --zone ZONE --accelerator v5p-128 [--spot] [--num-slices 2]
  python launch/tpu.py run    --name NAME --zone ZONE --accelerator v5p-128 [--num-slices 2] -- lm train --config ...
  python launch/tpu.py status --name NAME --zone ZONE
  python launch/tpu.py delete --name NAME --zone ZONE

`run` ships this checkout (a tarball of the files git tracks) to every worker of every slice,
installs it with the `tpu` extra, and runs the command on all workers at once, each worker's
output in LOG_DIR/<node>/worker-<i>.log; JAX finds the other hosts and slices from the TPU VM
itself (`lm.distributed`). When a worker fails (a hang found by train.hang_timeout_minutes exits 75), its error
line is repeated, naming the process that hung first, and the command is stopped on every worker.
With --dry-run every command prints, exactly, instead of running.
"""
from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

REMOTE_DIR = '$HOME/lm'  # expanded by the worker's shell
TARBALL = '/tmp/lm.tar.gz'
PID_FILE = '/tmp/lm.pid'  # on each worker: the running command's process id
POLL_SECONDS = 1.0


def hosts(accelerator: str) -> int:
  """Workers (VMs) of one slice: v4/v5p names count TensorCores (8 per host), v5e/v6e chips (4 per host
  from 16 chips; smaller slices are one host)."""
  match = re.fullmatch(r'(v4|v5p|v5litepod|v5e|v6e)-(\d+)', accelerator)
  if match is None:
    raise SystemExit(f'--accelerator {accelerator!r}: write a Cloud TPU type such as v5p-128, v5litepod-16 or v6e-64')
  generation, size = match.group(1), int(match.group(2))
  if generation in ('v4', 'v5p'):
    return max(1, size // 8)
  return 1 if size <= 8 else size // 4


def nodes(args: argparse.Namespace) -> list[str]:
  """The TPU VMs of the job: NAME, or NAME-0 ... NAME-{N-1} for N slices (the queued resource's node prefix)."""
  return [args.name] if args.num_slices == 1 else [f'{args.name}-{i}' for i in range(args.num_slices)]


def where(args: argparse.Namespace) -> list[str]:
  return [f'--zone={args.zone}'] + ([f'--project={args.project}'] if args.project else [])


def create_commands(args: argparse.Namespace) -> list[list[str]]:
  command = ['gcloud', 'compute', 'tpus', 'queued-resources', 'create', args.name, *where(args),
             f'--accelerator-type={args.accelerator}', f'--runtime-version={args.runtime_version}']
  command += [f'--node-id={args.name}'] if args.num_slices == 1 else [f'--node-count={args.num_slices}',
                                                                       f'--node-prefix={args.name}']
  if args.spot:
    command.append('--spot')
  return [command]


def ship_commands(args: argparse.Namespace) -> list[list[str]]:
  """Package the tracked files, copy them to every worker, unpack and install."""
  commands = [['git', 'archive', '--format=tar.gz', f'--output={TARBALL}', 'HEAD']]
  install = (f'mkdir -p {REMOTE_DIR} && tar -xzf {TARBALL} -C {REMOTE_DIR} && '
             f'python3 -m pip install -q -e "{REMOTE_DIR}[tpu]"')
  for node in nodes(args):
    commands.append(['gcloud', 'compute', 'tpus', 'tpu-vm', 'scp', TARBALL, f'{node}:{TARBALL}', *where(args),
                     '--worker=all'])
    commands.append(['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', node, *where(args), '--worker=all',
                     f'--command={install}'])
  return commands


def run_commands(args: argparse.Namespace) -> list[tuple[list[str], Path]]:
  """One ssh per worker (all run at once), with the local log it writes to. Each worker keeps its process id in
  PID_FILE, for `stop_commands`."""
  remote = (f'export PATH="$HOME/.local/bin:$PATH"; cd {REMOTE_DIR} || exit 1; {shlex.join(args.command)} & '
            f'echo $! > {PID_FILE}; wait $!')
  return [(['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', node, *where(args), f'--worker={w}', f'--command={remote}'],
           Path(args.log_dir) / node / f'worker-{w}.log')
          for node in nodes(args) for w in range(hosts(args.accelerator))]


def stop_commands(args: argparse.Namespace) -> list[list[str]]:
  """Ends the command on every worker: SIGTERM (a live process checkpoints and exits), SIGKILL 10 s later (one
  that hangs in a collective never will)."""
  stop = f'kill -TERM $(cat {PID_FILE}) 2>/dev/null; sleep 10; kill -KILL $(cat {PID_FILE}) 2>/dev/null; true'
  return [['gcloud', 'compute', 'tpus', 'tpu-vm', 'ssh', node, *where(args), '--worker=all', f'--command={stop}']
          for node in nodes(args)]


def first_error(log: Path) -> str:
  """The worker's `lm: error:` line (a hang's names the process that hung first), or ''."""
  lines = [line for line in log.read_text(errors='replace').splitlines() if line.startswith('lm: error: ')]
  return f': {lines[0].removeprefix("lm: error: ")}' if lines else ''


def watch(workers: list[tuple[list[str], Path]], procs: list[subprocess.Popen], args: argparse.Namespace) -> int:
  """Waits for every worker; the first to fail is named (with its error line) and the others are stopped."""
  while True:
    codes = [p.poll() for p in procs]
    failed = [(log, code) for (_, log), code in zip(workers, codes) if code not in (None, 0)]
    if failed:
      log, code = failed[0]
      print(f'tpu: {log} ended with status {code}{first_error(log)}; stopping the other workers', file=sys.stderr,
            flush=True)
      for command in stop_commands(args):
        subprocess.run(command, check=False)
      for p in procs:
        try:
          p.wait(timeout=60)
        except subprocess.TimeoutExpired:
          p.kill()
      return code
    if all(code == 0 for code in codes):
      return 0
    time.sleep(POLL_SECONDS)


def status_commands(args: argparse.Namespace) -> list[list[str]]:
  return [['gcloud', 'compute', 'tpus', 'queued-resources', 'describe', args.name, *where(args)]]


def delete_commands(args: argparse.Namespace) -> list[list[str]]:
  return [['gcloud', 'compute', 'tpus', 'queued-resources', 'delete', args.name, *where(args), '--force', '--quiet']]


def execute(args: argparse.Namespace) -> int:
  if args.action == 'run':
    staged = ship_commands(args)
    workers = run_commands(args)
    if args.dry_run:
      for command in staged:
        print(shlex.join(command))
      for command, log in workers:
        print(f'{shlex.join(command)} > {shlex.quote(str(log))} 2>&1 &')
      print('wait')
      for command in stop_commands(args):
        print(f'# when a worker fails: {shlex.join(command)}')
      return 0
    for command in staged:
      subprocess.run(command, check=True)
    procs = []
    for command, log in workers:
      log.parent.mkdir(parents=True, exist_ok=True)
      procs.append(subprocess.Popen(command, stdout=log.open('w'), stderr=subprocess.STDOUT))
    return watch(workers, procs, args)
  commands = {'create': create_commands, 'status': status_commands, 'delete': delete_commands}[args.action](args)
  for command in commands:
    if args.dry_run:
      print(shlex.join(command))
    else:
      subprocess.run(command, check=True)
  return 0


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('action', choices=('create', 'run', 'status', 'delete'))
  p.add_argument('--name', required=True, help='queued resource (and node, or node prefix) name')
  p.add_argument('--zone', required=True)
  p.add_argument('--project', default=None)
  p.add_argument('--accelerator', default='v5p-8', help='Cloud TPU type of one slice, e.g. v5p-128')
  p.add_argument('--runtime-version', default='v2-alpha-tpuv5', help='TPU VM software version')
  p.add_argument('--num-slices', type=int, default=1, help='slices joined over the data-center network')
  p.add_argument('--spot', action='store_true', help='spot capacity (preemptible) instead of on-demand')
  p.add_argument('--log-dir', default='logs/tpu', help='local directory of the per-worker logs (run)')
  p.add_argument('--dry-run', action='store_true', help='print the exact commands instead of running them')
  return p


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """(launcher arguments, the command after --)."""
  argv = list(argv)
  return (argv[:argv.index('--')], argv[argv.index('--') + 1:]) if '--' in argv else (argv, [])


def main(argv: Sequence[str] | None = None) -> int:
  own, command = split_command(sys.argv[1:] if argv is None else argv)
  args = parser().parse_args(own)
  args.command = command
  if args.action == 'run' and not args.command:
    raise SystemExit('tpu run needs the command to run after --, e.g. -- lm train --config gpt3_1_3b')
  return execute(args)


if __name__ == '__main__':
  sys.exit(main())
