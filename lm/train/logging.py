"""Run outputs: metrics.jsonl (one JSON object per logged step), TensorBoard events, progress bar.

All run-dir I/O goes through `etils.epath`, so a run dir may be a local path or a URI such as
gs://bucket/run. Object stores cannot append: there metrics.jsonl is rewritten whole at each log,
and TensorBoard events are written locally and copied up.
"""
from __future__ import annotations

import json
import math
import shutil
import sys
import tempfile
from typing import Any

from etils import epath
from tqdm import tqdm


def _summary_writer() -> type:
  """tensorboardX's SummaryWriter without the optional imports it makes where those libraries are installed: torch
  (2 s of every run's start) only to accept torch tensors, where we log floats; google-cloud-storage and boto3
  (1 s) for gs:// and s3:// event files, where ours are always local (a remote run dir's are copied up). While it
  imports, importing those fails."""
  blocked = [name for name in ('torch', 'google.cloud.storage', 'boto3') if name not in sys.modules]
  for name in blocked:
    sys.modules[name] = None  # type: ignore[assignment]  # makes `import name` raise ImportError
  try:
    from tensorboardX import SummaryWriter
  finally:
    for name in blocked:
      del sys.modules[name]
  return SummaryWriter


SummaryWriter = _summary_writer()

METRICS = 'metrics.jsonl'
MIN_BAR_COLUMNS = 40
TENSORBOARD = 'tensorboard'

_SHOWN = (('loss', 'loss {:.4f}'), ('val_loss', 'val_loss {:.4f}'), ('val_bpb', 'val_bpb {:.4f}'),
          ('learning_rate', 'lr {:.3g}'),
          ('grad_norm', 'grad_norm {:.3g}'), ('tokens_per_sec', '{:,.0f} tokens/s'), ('mfu', 'mfu {:.1%}'))


def format_record(record: dict[str, Any]) -> str:
  """One console line: `step 250 | loss 2.2990 | lr 0.000354 | grad_norm 0.741 | 3,412 tokens/s`."""
  parts = [f'step {record["step"]}'] + [fmt.format(record[k]) for k, fmt in _SHOWN if record.get(k) is not None]
  parts += [f'{k.split("/", 1)[1]} {v:.4f}' for k, v in record.items() if k.startswith(('val/', 'eval/'))]  # sets, tasks
  return ' | '.join(parts)


def is_local(path: epath.Path) -> bool:
  return '://' not in str(path)


def read_metrics(run_dir: str | epath.PathLike) -> list[dict[str, Any]]:
  path = epath.Path(run_dir) / METRICS
  return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


class MetricsLogger:
  """Writes every record to metrics.jsonl and TensorBoard; shows a bar on a terminal.

  A run resumed from step S keeps the records up to S and drops later ones (written before a crash and
  about to be written again); a run starting at step 0 starts a fresh file.
  """

  def __init__(self, run_dir: epath.Path, total_steps: int, start_step: int, progress: bool, enabled: bool = True):
    self.enabled = enabled
    if not enabled:
      return
    run_dir.mkdir(parents=True, exist_ok=True)
    self.path, self.local = run_dir / METRICS, is_local(run_dir)
    self.lines = [json.dumps(r) for r in read_metrics(run_dir) if start_step and r['step'] <= start_step]
    self.path.write_text(''.join(line + '\n' for line in self.lines))
    self.jsonl = self.path.open('a') if self.local else None
    events = run_dir / TENSORBOARD
    self.events_remote = None if self.local else events
    self.tensorboard = SummaryWriter(str(events) if self.local else tempfile.mkdtemp(prefix='lm_tensorboard_'))
    # A bar only on a terminal wide enough to draw it (some report 0 columns): else the step lines print.
    self.bar = tqdm(total=total_steps, initial=start_step, unit='step', dynamic_ncols=True) \
      if progress and sys.stdout.isatty() and shutil.get_terminal_size((0, 0)).columns >= MIN_BAR_COLUMNS else None
    self.shown: dict[str, str] = {}

  def log(self, record: dict[str, Any]) -> None:
    if not self.enabled:
      return
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    line = json.dumps(clean)
    if self.local:
      self.jsonl.write(line + '\n')
      self.jsonl.flush()
    else:
      self.lines.append(line)
      self.path.write_text(''.join(line + '\n' for line in self.lines))
    for key, value in record.items():
      if key != 'step' and isinstance(value, (int, float)):
        self.tensorboard.add_scalar(key, value, record['step'])
    if self.bar is not None and any(k.startswith('eval/') for k in record):
      self.bar.write(format_record(record))
    elif self.bar is not None:
      self.shown.update({k: f'{record[k]:.4g}' for k in ('loss', 'val_loss', 'tokens_per_sec') if k in record})
      self.bar.set_postfix(self.shown, refresh=False)
    elif 'tokens_per_sec' in record or 'val_loss' in record or any(k.startswith('eval/') for k in record):
      print(format_record(record), flush=True)

  def advance(self, steps: int) -> None:
    if self.enabled and self.bar is not None:
      self.bar.update(steps)

  def close(self) -> None:
    if not self.enabled:
      return
    if self.bar is not None:
      self.bar.close()
    if self.jsonl is not None:
      self.jsonl.close()
    self.tensorboard.close()
    if self.events_remote is not None:  # copy the local event files up
      self.events_remote.mkdir(parents=True, exist_ok=True)
      for event_file in epath.Path(self.tensorboard.logdir).iterdir():
        event_file.copy(self.events_remote / event_file.name, overwrite=True)
