"""SLURM clusters, GPU or CPU nodes: writes an sbatch script and submits it.

  python launch/slurm.py --job-name NAME --nodes 4 --gpus-per-node 8 [--time 24:00:00] [--partition P]
                         [--signal-seconds 300] [--dry-run] -- lm train --config gpt3_1_3b ...
  python launch/slurm.py --job-name NAME --nodes 2 --ntasks-per-node 4 -- lm train ...   # CPU nodes

With GPUs, one task per GPU (JAX gives each process its GPU: `lm.distributed` joins them through SLURM's
variables); without --gpus-per-node, --ntasks-per-node CPU processes per node. The command runs with
train.resume=true (put before your own overrides, so `train.resume=false` still wins), its program
written as an absolute path so the job does not depend on the PATH it was submitted from.

Stopping and resuming: SLURM signals the batch script `--signal-seconds` before the time limit, and
`scancel --signal=TERM --full` does too. The script passes SIGTERM on to the tasks, every process
checkpoints the same step and exits, process 0 leaving a note (the file LM_SLURM_REQUEUE names); the
script then requeues the job, which resumes from that checkpoint. A run that ends by itself is not
requeued, nor one that `scancel JOB` cancels (its tasks still checkpoint). `--requeue` also brings the
job back after a node failure or a preemption.

The coordinator's port: the batch script takes a free port on the first node (JAX_COORDINATOR_PORT, which
JAX reads; set it yourself to choose one). --dry-run prints, as shell, what a launch does: create the log
directory (SLURM opens --output before the script runs), write the script, submit it.
"""
from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from local import resolve as find_program  # launch/ is on the path of its own scripts

FREE_PORT = shlex.join([sys.executable, '-c', 'import socket; s = socket.socket(); s.bind(("", 0)); '
                                                 'print(s.getsockname()[1])'])


def resolve(program: str) -> str:
  """`program` as an absolute path, found as launch/local.py finds it (PATH, else beside this Python)."""
  found = find_program([program])[0]
  return str(Path(shutil.which(found) or found).absolute())


def with_resume(command: Sequence[str]) -> list[str]:
  """`command` with train.resume=true before its first key=value override (so the user's own wins)."""
  command = list(command)
  first = next((i for i, a in enumerate(command) if '=' in a and not a.startswith('-')), len(command))
  return [*command[:first], 'train.resume=true', *command[first:]]


def script(args: argparse.Namespace) -> str:
  tasks = args.ntasks_per_node or args.gpus_per_node or 1
  directives = [f'--job-name={args.job_name}', f'--nodes={args.nodes}', f'--ntasks-per-node={tasks}']
  if args.gpus_per_node:
    directives.append(f'--gpus-per-node={args.gpus_per_node}')
  if args.cpus_per_task:
    directives.append(f'--cpus-per-task={args.cpus_per_task}')
  directives += [f'--time={args.time}', f'--signal=B:TERM@{args.signal_seconds}', '--requeue', '--open-mode=append',
                 f'--output={args.log_dir}/%x-%j.out']
  if args.partition:
    directives.append(f'--partition={args.partition}')
  command = shlex.join(with_resume([resolve(args.command[0]), *args.command[1:]]))
  return '\n'.join([
    '#!/bin/bash', *[f'#SBATCH {d}' for d in directives],
    'set -uo pipefail',
    '# SIGTERM to this script (the time limit is near, or scancel --signal=TERM --full) goes on to the',
    '# tasks through SLURM, once; srun takes a SIGTERM of its own as an order to kill them, so it runs apart.',
    "trap 'trap \"\" TERM; timeout 10 scancel --signal=TERM \"$SLURM_JOB_ID\"' TERM",
    f'export JAX_COORDINATOR_PORT="${{JAX_COORDINATOR_PORT:-$({FREE_PORT})}}"',
    '# Process 0 creates this file after a stop by SIGTERM, its checkpoint written: the job then requeues.',
    f'export LM_SLURM_REQUEUE={shlex.quote(str(Path(args.log_dir).absolute()))}/$SLURM_JOB_NAME-$SLURM_JOB_ID.requeue',
    'rm -f "$LM_SLURM_REQUEUE"',
    '# The first process to end a stalled job (a hang, a process that never joined) writes its line here.',
    f'export LM_HANG_REPORT={shlex.quote(str(Path(args.log_dir).absolute()))}/$SLURM_JOB_NAME-$SLURM_JOB_ID.stalled',
    'rm -f "$LM_HANG_REPORT"',
    '# --kill-on-bad-exit: a task that fails (a hang found, exit 75) ends the others',
    f'setsid srun --kill-on-bad-exit=1 --output={args.log_dir}/%x-%j-%t.out {command} &',
    'step=$!',
    'while kill -0 $step 2>/dev/null; do wait $step; done  # a trapped signal ends `wait` early',
    'wait $step; status=$?',
    'if [ -e "$LM_HANG_REPORT" ]; then echo "slurm: job $SLURM_JOB_ID stalled: $(cat "$LM_HANG_REPORT")"; fi',
    'if [ -e "$LM_SLURM_REQUEUE" ]; then',
    '  rm -f "$LM_SLURM_REQUEUE"; trap "" TERM',
    '  if scontrol show job -o "$SLURM_JOB_ID" | grep -q JobState=RUNNING; then  # not when scancel ended it',
    '    echo "stopped by SIGTERM with a checkpoint: requeueing job $SLURM_JOB_ID, which resumes from it"',
    '    scontrol requeue "$SLURM_JOB_ID"',
    '  else',
    '    echo "stopped by SIGTERM with a checkpoint; job $SLURM_JOB_ID was cancelled, so it stays so"',
    '  fi',
    'fi',
    'exit $status', ''])


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--job-name', required=True)
  p.add_argument('--nodes', type=int, required=True)
  p.add_argument('--gpus-per-node', type=int, default=0, help='GPUs per node, one task each (default: CPU nodes)')
  p.add_argument('--ntasks-per-node', type=int, default=None,
                 help='processes per node (default: one per GPU, or 1 on CPU nodes)')
  p.add_argument('--cpus-per-task', type=int, default=None, help='CPUs per process (default: the cluster\'s)')
  p.add_argument('--time', default='24:00:00', help='time limit, HH:MM:SS')
  p.add_argument('--partition', default=None)
  p.add_argument('--signal-seconds', type=int, default=300, help='SIGTERM this long before the time limit')
  p.add_argument('--log-dir', default='logs/slurm')
  p.add_argument('--script', default=None, help='where to write the sbatch script (default JOB_NAME.sbatch)')
  p.add_argument('--dry-run', action='store_true', help='print the script instead of submitting it')
  return p


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """(launcher arguments, the command after --)."""
  argv = list(argv)
  return (argv[:argv.index('--')], argv[argv.index('--') + 1:]) if '--' in argv else (argv, [])


def main(argv: Sequence[str] | None = None) -> int:
  own, command = split_command(sys.argv[1:] if argv is None else argv)
  p = parser()
  args = p.parse_args(own)
  args.command = command
  if not args.command:
    p.error('give the command to run after --, e.g. -- lm train --config gpt3_1_3b')
  for flag in ('nodes', 'ntasks_per_node', 'cpus_per_task'):
    if getattr(args, flag) is not None and getattr(args, flag) < 1:
      p.error(f'--{flag.replace("_", "-")} must be at least 1')
  if args.gpus_per_node < 0:
    p.error('--gpus-per-node must be 0 (CPU nodes) or more')
  text = script(args)
  path = Path(args.script or f'{args.job_name}.sbatch')
  if args.dry_run:  # what a real launch does, as shell
    print(f"mkdir -p {shlex.quote(args.log_dir)}\ncat > {shlex.quote(str(path))} <<'EOF'\n{text}EOF\n"
          f"sbatch {shlex.quote(str(path))}")
    return 0
  # SLURM opens --output before the script runs: the directory must exist at submission.
  Path(args.log_dir).mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  return subprocess.run(['sbatch', str(path)]).returncode


if __name__ == '__main__':
  sys.exit(main())
