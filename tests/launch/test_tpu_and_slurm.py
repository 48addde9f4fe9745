"""launch/tpu.py and launch/slurm.py --dry-run print exactly the commands and script they would run."""
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
  run = ("'--command=export PATH=\"$HOME/.local/bin:$PATH\" && cd $HOME/lm && "
         "lm train --config gpt3_1_3b data.name=c4/en:3.1.0'")
  expected = ['git archive --format=tar.gz --output=/tmp/lm.tar.gz HEAD']
  for node in ('pod-0', 'pod-1'):
    expected += [f'gcloud compute tpus tpu-vm scp /tmp/lm.tar.gz {node}:/tmp/lm.tar.gz --zone=z --worker=all',
                 f'gcloud compute tpus tpu-vm ssh {node} --zone=z --worker=all {install}']
  expected += [f'gcloud compute tpus tpu-vm ssh {node} --zone=z --worker={w} {run} > logs/tpu/{node}/worker-{w}.log '
               f'2>&1 &' for node in ('pod-0', 'pod-1') for w in (0, 1)]  # v5p-16: 8 chips, 2 hosts per slice
  assert out.splitlines() == expected + ['wait']


def test_slurm_script():
  assert dry_run('slurm.py', '--job-name', 'gpt', '--nodes', '4', '--gpus-per-node', '8', '--partition', 'gpu',
                 '--time', '12:00:00', '--signal-seconds', '600', '--dry-run', '--', 'lm', 'train', '--config',
                 'gpt3_1_3b', 'mesh.fsdp=32') == '''mkdir -p logs/slurm
cat > gpt.sbatch <<'EOF'
#!/bin/bash
#SBATCH --job-name=gpt
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=8
#SBATCH --time=12:00:00
#SBATCH --signal=TERM@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/slurm/%x-%j.out
#SBATCH --partition=gpu
set -euo pipefail
srun --kill-on-bad-exit=1 --output=logs/slurm/%x-%j-%t.out lm train --config gpt3_1_3b mesh.fsdp=32 train.resume=true
EOF
sbatch gpt.sbatch
'''
