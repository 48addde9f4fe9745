"""launch/tpu.py and launch/slurm.py --dry-run print the commands and script they would run; a failed TPU worker
stops the others."""
import subprocess
import sys
from pathlib import Path

LAUNCH = Path(__file__).resolve().parents[2] / 'launch'


def dry_run(script, *argv):
  out = subprocess.run([sys.executable, str(LAUNCH / script), *argv], capture_output=True, text=True, check=True)
  return out.stdout


def test_tpu_create_status_delete_single_and_multislice():
  assert dry_run('tpu.py', 'create', '--name', 'pod', '--zone', 'us-east5-a', '--project', 'p', '--accelerator',
                 'v5p-128', '--dry-run') == (
    'gcloud compute tpus queued-resources create pod --zone=us-east5-a --project=p --accelerator-type=v5p-128 '
    '--runtime-version=v2-alpha-tpuv5 --node-id=pod\n')
  assert dry_run('tpu.py', 'create', '--name', 'pod', '--zone', 'z', '--accelerator', 'v5e-16', '--num-slices', '2',
                 '--spot', '--runtime-version', 'v2-alpha-tpuv5-lite', '--dry-run') == (
    'gcloud compute tpus queued-resources create pod --zone=z --accelerator-type=v5e-16 '
    '--runtime-version=v2-alpha-tpuv5-lite --node-count=2 --node-prefix=pod --spot\n')
  assert dry_run('tpu.py', 'status', '--name', 'pod', '--zone', 'z', '--dry-run') == \
    'gcloud compute tpus queued-resources describe pod --zone=z\n'
  assert dry_run('tpu.py', 'delete', '--name', 'pod', '--zone', 'z', '--dry-run') == \
    'gcloud compute tpus queued-resources delete pod --zone=z --force --quiet\n'


def test_tpu_run_ships_installs_and_runs_on_every_worker_of_every_slice():
  out = dry_run('tpu.py', 'run', '--name', 'pod', '--zone', 'z', '--accelerator', 'v5p-16', '--num-slices', '2',
                '--dry-run', '--', 'lm', 'train', '--config', 'gpt3_1_3b', 'data.name=c4/en:3.1.0')
  install = ("'--command=mkdir -p $HOME/lm && tar -xzf /tmp/lm.tar.gz -C $HOME/lm && "
             "python3 -m pip install -q -e \"$HOME/lm[tpu]\"'")
  run = ("'--command=export PATH=\"$HOME/.local/bin:$PATH\"; cd $HOME/lm || exit 1; "
         "lm train --config gpt3_1_3b data.name=c4/en:3.1.0 & echo $! > /tmp/lm.pid; wait $!'")
  stop = ("'--command=kill -TERM $(cat /tmp/lm.pid) 2>/dev/null; sleep 10; kill -KILL $(cat /tmp/lm.pid) "
          "2>/dev/null; true'")
  expected = ['git archive --format=tar.gz --output=/tmp/lm.tar.gz HEAD']
  for node in ('pod-0', 'pod-1'):
    expected += [f'gcloud compute tpus tpu-vm scp /tmp/lm.tar.gz {node}:/tmp/lm.tar.gz --zone=z --worker=all',
                 f'gcloud compute tpus tpu-vm ssh {node} --zone=z --worker=all {install}']
  expected += [f'gcloud compute tpus tpu-vm ssh {node} --zone=z --worker={w} {run} > logs/tpu/{node}/worker-{w}.log '
               f'2>&1 &' for node in ('pod-0', 'pod-1') for w in (0, 1)]  # v5p-16: 8 chips, 2 hosts per slice
  assert out.splitlines() == expected + ['wait'] + [
    f'# when a worker fails: gcloud compute tpus tpu-vm ssh {node} --zone=z --worker=all {stop}'
    for node in ('pod-0', 'pod-1')]


def test_tpu_run_names_the_failed_worker_and_stops_the_others(tmp_path, monkeypatch, capsys):
  """Worker 1 ends a hung job (exit 75, its error line naming the process that hung first): the launcher repeats
  the line and runs the stop command, which ends worker 0."""
  sys.path.insert(0, str(LAUNCH))
  import tpu
  logs = [tmp_path / f'worker-{w}.log' for w in range(2)]
  hang = 'lm: error: process 1 of 2: no step done in 5 minutes after step 40; process 0 hung first (no heartbeat)'
  scripts = ['import time; time.sleep(300)', f'import sys; print({hang!r}); sys.exit(75)']
  procs = [subprocess.Popen([sys.executable, '-c', script], stdout=log.open('w'), stderr=subprocess.STDOUT)
           for script, log in zip(scripts, logs)]
  monkeypatch.setattr(tpu, 'stop_commands', lambda args: [['kill', '-TERM', str(procs[0].pid)]])
  assert tpu.watch([([], log) for log in logs], procs, None) == 75
  assert procs[0].returncode == -15  # stopped
  assert capsys.readouterr().err == (f'tpu: {logs[1]} ended with status 75: {hang.removeprefix("lm: error: ")}; '
                                     f'stopping the other workers\n')


def slurm_dry_run(*argv):
  """(shell lines around the script, the sbatch script's lines) of `launch/slurm.py --dry-run`."""
  out = dry_run('slurm.py', '--job-name', 'gpt', '--dry-run', *argv)
  head, script = out.split("<<'EOF'\n")
  script, tail = script.split('EOF\n')
  return [line.strip() for line in head.splitlines() + tail.splitlines()], script.splitlines()


def test_slurm_gpu_and_cpu_scripts():
  around, script = slurm_dry_run('--nodes', '4', '--gpus-per-node', '8', '--partition', 'gpu', '--time', '12:00:00',
                                 '--signal-seconds', '600', '--', 'lm', 'train', '--config', 'gpt3_1_3b',
                                 'mesh.fsdp=32')
  assert around == ['mkdir -p logs/slurm', 'cat > gpt.sbatch', 'sbatch gpt.sbatch']  # the log dir before sbatch
  for directive in ('--nodes=4', '--ntasks-per-node=8', '--gpus-per-node=8', '--time=12:00:00',
                    '--signal=B:TERM@600', '--requeue', '--partition=gpu', '--output=logs/slurm/%x-%j.out'):
    assert f'#SBATCH {directive}' in script
  assert not any('--cpus-per-task' in line for line in script)  # the cluster's default unless asked
  srun = next(line for line in script if line.startswith('setsid srun '))
  lm = str(Path(sys.executable).parent / 'lm')  # absolute: the job does not need the submitter's PATH
  assert f'{lm} train --config gpt3_1_3b train.resume=true mesh.fsdp=32' in srun  # the user's overrides win

  _, cpu = slurm_dry_run('--nodes', '2', '--ntasks-per-node', '3', '--cpus-per-task', '4', '--', 'lm', 'train')
  assert '#SBATCH --ntasks-per-node=3' in cpu and '#SBATCH --cpus-per-task=4' in cpu
  assert not any('gpus' in line for line in cpu)
  _, one = slurm_dry_run('--nodes', '1', '--', 'lm', 'train')
  assert '#SBATCH --ntasks-per-node=1' in one and f'{lm} train train.resume=true &' in '\n'.join(one)


def test_slurm_bad_arguments_are_one_line():
  for argv, message in ((['--nodes', '1', '--gpus-per-node', '-1', '--', 'lm'], '--gpus-per-node must be 0'),
                        (['--nodes', '0', '--', 'lm'], '--nodes must be at least 1'),
                        (['--nodes', '1'], 'give the command to run after --'),
                        (['--nodes', '1', '--', 'no_such_program_here'], 'no_such_program_here is not on PATH')):
    out = subprocess.run([sys.executable, str(LAUNCH / 'slurm.py'), '--job-name', 'x', '--dry-run', *argv],
                         capture_output=True, text=True)
    assert out.returncode != 0 and message in out.stderr and out.stderr.strip().splitlines()[-1].count('\n') == 0
