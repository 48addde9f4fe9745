"""Run outputs: metrics.jsonl (one JSON object per logged step), TensorBoard events, progress bar."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter
from tqdm import tqdm


_SHOWN = (('loss', 'loss {:.4f}'), ('val_loss', 'val_loss {:.4f}'), ('learning_rate', 'lr {:.3g}'),
          ('grad_norm', 'grad_norm {:.3g}'), ('tokens_per_sec', '{:,.0f} tokens/s'), ('mfu', 'mfu {:.1%}'))


def format_record(record: dict[str, Any]) -> str:
  """One console line: `step 250 | loss 2.2990 | lr 0.000354 | grad_norm 0.741 | 3,412 tokens/s`."""
  parts = [f'step {record["step"]}'] + [fmt.format(record[k]) for k, fmt in _SHOWN if record.get(k) is not None]
  return ' | '.join(parts)


class MetricsLogger:
  """Writes every record to metrics.jsonl and TensorBoard; shows a bar on a terminal."""

  def __init__(self, run_dir: Path, total_steps: int, start_step: int, progress: bool, enabled: bool = True):
    self.enabled = enabled
    if not enabled:
      return
    run_dir.mkdir(parents=True, exist_ok=True)
    self.jsonl = open(run_dir / 'metrics.jsonl', 'a')
    self.tensorboard = SummaryWriter(str(run_dir / 'tensorboard'))
    self.bar = tqdm(total=total_steps, initial=start_step, unit='step', dynamic_ncols=True) \
      if progress and sys.stdout.isatty() else None
    self.shown: dict[str, str] = {}

  def log(self, record: dict[str, Any]) -> None:
    if not self.enabled:
      return
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
    self.jsonl.write(json.dumps(clean) + '\n')
    self.jsonl.flush()
    for key, value in record.items():
      if key != 'step' and isinstance(value, (int, float)):
        self.tensorboard.add_scalar(key, value, record['step'])
    if self.bar is not None:
      self.shown.update({k: f'{record[k]:.4g}' for k in ('loss', 'val_loss', 'tokens_per_sec') if k in record})
      self.bar.set_postfix(self.shown, refresh=False)
    elif 'tokens_per_sec' in record or 'val_loss' in record:
      print(format_record(record), flush=True)

  def advance(self, steps: int) -> None:
    if self.enabled and self.bar is not None:
      self.bar.update(steps)

  def close(self) -> None:
    if self.enabled:
      if self.bar is not None:
        self.bar.close()
      self.jsonl.close()
      self.tensorboard.close()
