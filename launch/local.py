"""Runs a command as N local CPU processes forming one JAX job (gloo collectives): for tests and laptops.

  python launch/local.py --processes 2 --devices-per-process 4 -- lm train --config gpt_tiny mesh.data=2 mesh.fsdp=4

Each process gets LM_COORDINATOR_ADDRESS, LM_NUM_PROCESSES and LM_PROCESS_ID (read by
`lm.distributed`) and K simulated CPU devices. Process 0's output is shown here; the others' goes to
LOG_DIR/process_<i>.log; gloo's per-connection notices are left out of both. If a process fails, the
others are stopped and the launcher exits with its status; SIGTERM and SIGINT are passed on to every process.
A process that ends a stalled job (train.hang_timeout_minutes, train.join_timeout_minutes) exits with STALLED
and writes its line, which names the process that hung first, to LOG_DIR/stalled.txt: the launcher repeats it.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import pty
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import termios
import threading
import time
from pathlib import Path
from typing import BinaryIO, Sequence


def free_port() -> int:
  with socket.socket() as s:
    s.bind(('localhost', 0))
    return s.getsockname()[1]


STALLED = 75  # lm.distributed.STALLED: a process ended a stalled job (a hang, or a process that never joined)
STALLED_REPORT = 'stalled.txt'  # in the log dir: the first stalled process's line (lm.distributed.HANG_REPORT)


def process_env(index: int, processes: int, devices: int, port: int, log_dir: Path) -> dict[str, str]:
  flags = [f for f in os.environ.get('XLA_FLAGS', '').split() if not f.startswith('--xla_force_host_platform')]
  return {**os.environ, 'LM_COORDINATOR_ADDRESS': f'localhost:{port}', 'LM_NUM_PROCESSES': str(processes),
          'LM_PROCESS_ID': str(index), 'JAX_PLATFORMS': 'cpu', 'LM_HANG_REPORT': str(log_dir / STALLED_REPORT),
          'XLA_FLAGS': ' '.join(flags + [f'--xla_force_host_platform_device_count={devices}'])}


def stop(procs: Sequence[subprocess.Popen], grace: float = 10.0) -> None:
  for p in procs:
    if p.poll() is None:
      p.terminate()
  deadline = time.monotonic() + grace
  for p in procs:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()


# gloo's notice for each connection, printed on stdout by every process for every device group from several
# threads at once, each notice in eight writes ('[Gloo] Rank ', rank, ' is connected to ', count, ...), so
# notices interleave piece by piece. A cluster starts at an opening piece and ends at the newline that closes
# its last open notice; one that holds anything but these pieces, digits and line ends is not gloo's and stays.
OPENER = b'[Gloo] Rank '
PIECES = (OPENER, b' is connected to ', b' peer ranks. ', b'Expected number of connected peer ranks is : ')


def notice_cluster(text: bytes, start: int) -> int | None:
  """The end of the cluster of notices opening at `start`; None if `text` ends first; -1 if it is not one."""
  opened, i = 0, start
  while i < len(text):
    piece = next((p for p in PIECES if text.startswith(p, i)), None)
    if piece is not None:
      opened += piece is OPENER
      i += len(piece)
    elif text[i:i + 1] == b'\n':
      opened, i = opened - 1, i + 1
      if opened == 0:
        return i
    elif text[i:i + 1].isdigit() or text[i:i + 1] == b'\r':
      i += 1
    elif any(p.startswith(text[i:]) for p in PIECES):
      return None
    else:
      return -1
  return None


def without_notices(text: bytes, final: bool) -> tuple[bytes, bytes]:
  """(`text` without gloo's notices, the tail from a cluster still open: held back for more unless `final`)."""
  kept, at = [], 0
  while (start := text.find(OPENER, at)) >= 0:
    end = notice_cluster(text, start)
    if end is None and not final:
      return b''.join([*kept, text[at:start]]), text[start:]
    if end is None or end < 0:  # not gloo's (or cut off by EOF): it stays
      end = start + len(OPENER)
      kept.append(text[at:end])
    else:
      kept.append(text[at:start])
    at = end
  return b''.join([*kept, text[at:]]), b''


def relay(source: int, sink: BinaryIO) -> None:
  """Copies the file descriptor `source` to `sink` line by line (a line ends in \\n or \\r, so progress bars
  pass at once) without gloo's notices, until EOF."""
  pending = b''
  while True:
    try:
      chunk = os.read(source, 1 << 16)
    except OSError:  # a pseudo-terminal whose process has exited
      chunk = b''
    text, held = without_notices(pending + chunk, final=not chunk)
    *lines, partial = re.split(rb'(?<=\n)|(?<=\r)(?!\n)', text)  # \r\n stays one line
    sink.write(b''.join(lines if chunk else [*lines, partial]))
    sink.flush()
    pending = partial + held
    if not chunk:
      os.close(source)
      return


def output_pipe() -> tuple[int, int]:
  """(read end, write end) for process 0's stdout: a pseudo-terminal of this terminal's size when stdout is
  one (so `lm` still draws its progress bar), else a pipe."""
  if not sys.stdout.isatty():
    return os.pipe()
  reader, writer = pty.openpty()
  fcntl.ioctl(writer, termios.TIOCSWINSZ, fcntl.ioctl(sys.stdout.fileno(), termios.TIOCGWINSZ, bytes(8)))
  return reader, writer


def launch(command: Sequence[str], processes: int, devices_per_process: int, log_dir: Path) -> int:
  """Runs `command` as `processes` processes; returns the first non-zero exit status, or 0."""
  port = free_port()
  log_dir.mkdir(parents=True, exist_ok=True)
  (log_dir / STALLED_REPORT).unlink(missing_ok=True)
  procs, logs, relays = [], [], []
  for i in range(processes):
    log = None if i == 0 else open(log_dir / f'process_{i}.log', 'wb')
    logs.append(log)
    reader, writer = output_pipe() if i == 0 else os.pipe()
    procs.append(subprocess.Popen(list(command), env=process_env(i, processes, devices_per_process, port, log_dir),
                                  stdout=writer, stderr=None if i == 0 else writer))
    os.close(writer)
    relays.append(threading.Thread(target=relay, args=(reader, log or sys.stdout.buffer), daemon=True))
    relays[-1].start()
  forward = lambda signum, _: [p.send_signal(signum) for p in procs if p.poll() is None]
  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    while True:
      codes = [p.poll() for p in procs]
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        index, code = failed[0]
        where = 'above' if index == 0 else f'in {log_dir / f"process_{index}.log"}'
        report = log_dir / STALLED_REPORT
        why = f': {report.read_text().strip()}' if code == STALLED and report.exists() else ''
        print(f'launch: process {index} exited with status {code} (its output is {where}){why}; stopping the others',
              file=sys.stderr, flush=True)
        stop(procs)
        return code
      if all(c == 0 for c in codes):
        return 0
      time.sleep(0.1)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)
    for thread in relays:
      thread.join(timeout=10)
    for log in logs:
      if log is not None:
        log.close()


def resolve(command: list[str]) -> list[str]:
  """The command with its program found on PATH, or else beside this Python (`lm` in a venv that is not
  activated); a SystemExit naming the fix when it is in neither place."""
  program = command[0]
  if os.sep in program or shutil.which(program):
    return command
  beside = Path(sys.executable).parent / program
  if beside.is_file() and os.access(beside, os.X_OK):
    return [str(beside), *command[1:]]
  raise SystemExit(f'launch: {program} is not on PATH nor beside {sys.executable}; activate the venv that has it '
                   f'(source .venv/bin/activate) or give its full path')


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """(launcher arguments, the command after --)."""
  argv = list(argv)
  return (argv[:argv.index('--')], argv[argv.index('--') + 1:]) if '--' in argv else (argv, [])


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--processes', type=int, required=True)
  parser.add_argument('--devices-per-process', type=int, default=1)
  parser.add_argument('--log-dir', type=Path, default=None, help='where processes 1.. write (default: a temp dir)')
  own, command = split_command(sys.argv[1:] if argv is None else argv)
  args = parser.parse_args(own)
  if not command or args.processes < 1 or args.devices_per_process < 1:
    parser.error('give --processes N >= 1, --devices-per-process K >= 1 and a command after --')
  log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix='lm_launch_'))
  return launch(resolve(command), args.processes, args.devices_per_process, log_dir)


if __name__ == '__main__':
  sys.exit(main())
