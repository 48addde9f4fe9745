"""GPU clusters through SLURM: writes an sbatch script and submits it.

  python launch/slurm.py --job-name NAME --nodes 4 --gpus-per-node 8 [--time 24:00:00] [--partition P]
                         [--signal-seconds 300] [--dry-run] -- lm train --config gpt3_1_3b ...

One task per GPU (JAX then gives each process its GPU: `lm.distributed` joins them through
SLURM's variables). SLURM sends SIGTERM `--signal-seconds` before the time limit, on which every
process checkpoints the same step and exits; the job may be requeued (`--requeue`) after a
preemption or node failure, and the command runs with train.resume=true so it continues from
the last checkpoint. --dry-run prints, as shell, what a launch does: create the log directory (SLURM opens
--output before the script runs), write the script, submit it.
"""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Sequence


def script(args: argparse.Namespace) -> str:
  directives = [f'--job-name={args.job_name}', f'--nodes={args.nodes}', f'--ntasks-per-node={args.gpus_per_node}',
                f'--gpus-per-node={args.gpus_per_node}', f'--cpus-per-task={args.cpus_per_task}',
                f'--time={args.time}', f'--signal=TERM@{args.signal_seconds}', '--requeue', '--open-mode=append',
                f'--output={args.log_dir}/%x-%j.out']
  if args.partition:
    directives.append(f'--partition={args.partition}')
  command = shlex.join([*args.command, 'train.resume=true'])
  return '\n'.join(['#!/bin/bash', *[f'#SBATCH {d}' for d in directives], 'set -euo pipefail',
                    f'srun --kill-on-bad-exit=1 --output={args.log_dir}/%x-%j-%t.out {command}', ''])


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--job-name', required=True)
  p.add_argument('--nodes', type=int, required=True)
  p.add_argument('--gpus-per-node', type=int, default=8)
  p.add_argument('--cpus-per-task', type=int, default=8)
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
  args = parser().parse_args(own)
  args.command = command
  if not args.command:
    raise SystemExit('slurm needs the command to run after --, e.g. -- lm train --config gpt3_1_3b')
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
