"""Run outputs: metrics.jsonl (one JSON object per logged step), the trackers (`lm.train.trackers`: TensorBoard,
W&B), progress bar.

All run-dir I/O goes through `etils.epath`, so a run dir may be a local path or a URI such as
gs://bucket/run. Object stores cannot append: there metrics.jsonl is rewritten whole at each log.
"""
from __future__ import annotations

import json
import math
import shutil
import sys
from typing import Any, Sequence

from etils import epath
from tqdm import tqdm

from lm.train.trackers import TensorBoard, Tracker, is_local

METRICS = 'metrics.jsonl'
MIN_BAR_COLUMNS = 40

_SHOWN = (('loss', 'loss {:.4f}'), ('val_loss', 'val_loss {:.4f}'), ('val_bpb', 'val_bpb {:.4f}'),
          ('learning_rate', 'lr {:.3g}'),
          ('grad_norm', 'grad_norm {:.3g}'), ('tokens_per_sec', '{:,.0f} tokens/s'), ('mfu', 'mfu {:.1%}'))


def format_record(record: dict[str, Any]) -> str:
  """One console line: `step 250 | loss 2.2990 | lr 0.000354 | grad_norm 0.741 | 3,412 tokens/s`."""
  parts = [f'step {record["step"]}'] + [fmt.format(record[k]) for k, fmt in _SHOWN if record.get(k) is not None]
  parts += [f'{k.split("/", 1)[1]} {v:.4f}' for k, v in record.items() if k.startswith(('val/', 'eval/'))]  # sets, tasks
  return ' | '.join(parts)


def read_metrics(run_dir: str | epath.PathLike) -> list[dict[str, Any]]:
  path = epath.Path(run_dir) / METRICS
  return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


class MetricsLogger:
  """Writes every record to metrics.jsonl and hands it to the `trackers` (default: TensorBoard; they stay
  open: their owner closes them); shows a bar on a terminal.

  A run resumed from step S keeps the records up to S and drops later ones (written before a crash and
  about to be written again); a run starting at step 0 starts a fresh file.
  """

  def __init__(self, run_dir: epath.Path, total_steps: int, start_step: int, progress: bool, enabled: bool = True,
               trackers: Sequence[Tracker] | None = None):
    self.enabled = enabled
    if not enabled:
      return
    run_dir.mkdir(parents=True, exist_ok=True)
    self.path, self.local = run_dir / METRICS, is_local(run_dir)
    self.lines = [json.dumps(r) for r in read_metrics(run_dir) if start_step and r['step'] <= start_step]
    self.path.write_text(''.join(line + '\n' for line in self.lines))
    self.jsonl = self.path.open('a') if self.local else None
    self.owned = [TensorBoard(run_dir)] if trackers is None else []
    self.trackers = list(trackers) if trackers is not None else self.owned
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
    for tracker in self.trackers:
      tracker.log(record)
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
    for tracker in self.owned:
      tracker.close()
