"""`lm` commands run by forks of one process that imported lm's modules once: test_readme's ~50 commands each
spent ~2.5 of their ~10 CPU-s importing. A fork is a new process to the command it runs: it takes its working
directory, arguments and standard streams (files) from the request, starts JAX's backends itself (the parent
only imports, and checks it started none), and exits as the `lm` script does (its exit handlers, then main's
code). The parent's own stderr (what importing printed) is the caller's to check.

`Forks` starts the process (in the environment the commands should see) and sends it the commands: one JSON
request per stdin line ({"argv", "cwd", "stdout", "stderr"}), one JSON reply per stdout line ({"returncode"})."""
import atexit
import importlib
import json
import os
import pkgutil
import select
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from jax._src import xla_bridge

import lm


def preload() -> None:
  """Every module of lm (what a command imports besides them, it imports in its fork)."""
  for module in pkgutil.walk_packages(lm.__path__, 'lm.'):
    importlib.import_module(module.name)
  assert not xla_bridge.backends_are_initialized(), 'importing lm started a JAX backend: forks would share it'


def run(request: dict) -> None:
  """In the fork: the command, then the exit an `lm` process makes (never returns)."""
  code = 1
  try:
    os.chdir(request['cwd'])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request['stdout'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request['stderr'], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
      opened = os.open(path, flags)
      os.dup2(opened, fd)
      os.close(opened)
    sys.argv = ['lm', *request['argv']]
    from lm.cli import main
    code = main(request['argv'])
  except SystemExit as e:  # argparse's errors; sys.exit('message') prints its message as Python does
    code = e.code if isinstance(e.code, int) else int(e.code is not None)
    if isinstance(e.code, str):
      print(e.code, file=sys.stderr)
  except BaseException:
    traceback.print_exc()
  finally:
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve() -> None:
  preload()
  for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      run(request)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({'returncode': os.waitstatus_to_exitcode(status)}), flush=True)


class Forks:
  """The forking process, for `with Forks(env) as lm: lm.run(argv, cwd)`; on leaving, what the process itself
  printed on stderr (importing lm: what every `lm` command would print) is `startup_stderr`."""

  def __init__(self, env: dict[str, str]):
    self.env, self.startup_stderr = env, None

  def __enter__(self) -> 'Forks':
    self.dir = tempfile.TemporaryDirectory()
    self.stderr = open(Path(self.dir.name) / 'server.err', 'w+')
    # -P: no script directory on sys.path (tests/ holds folders named like packages), as for the `lm` script
    self.process = subprocess.Popen([sys.executable, '-P', __file__], env=self.env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=self.stderr, text=True, start_new_session=True)
    return self

  def run(self, argv: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess:
    out, err = Path(self.dir.name) / 'out', Path(self.dir.name) / 'err'
    request = {'argv': argv, 'cwd': str(cwd), 'stdout': str(out), 'stderr': str(err)}
    self.process.stdin.write(json.dumps(request) + '\n')
    self.process.stdin.flush()
    if not select.select([self.process.stdout], [], [], timeout)[0]:
      os.killpg(self.process.pid, signal.SIGKILL)  # the process and its fork (one session)
      raise subprocess.TimeoutExpired(['lm', *argv], timeout)
    reply = self.process.stdout.readline()
    assert reply, f'the forking process ended (exit {self.process.wait()}): {self._startup()}'
    return subprocess.CompletedProcess(['lm', *argv], json.loads(reply)['returncode'], out.read_text(),
                                       err.read_text())

  def _startup(self) -> str:
    self.stderr.seek(0)
    return self.stderr.read()

  def __exit__(self, *exc) -> None:
    self.process.stdin.close()
    self.process.wait(timeout=60)
    self.startup_stderr = self._startup()
    self.stderr.close()
    self.dir.cleanup()


if __name__ == '__main__':
  serve()
