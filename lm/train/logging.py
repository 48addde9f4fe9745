"""Run outputs: metrics.jsonl (one JSON object per logged step), TensorBoard events, progress bar."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from tensorboardX import SummaryWriter
from tqdm import tqdm


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
      shown = {k: f'{record[k]:.4g}' for k in ('loss', 'val_loss', 'tokens_per_sec') if k in record}
      self.bar.set_postfix(shown, refresh=False)
    elif 'loss' in record or 'val_loss' in record:
      print(' '.join(f'{k}={v:.4g}' if isinstance(v, float) else f'{k}={v}' for k, v in record.items()
                     if v is not None), flush=True)

  def advance(self, steps: int) -> None:
    if self.enabled and self.bar is not None:
      self.bar.update(steps)

  def close(self) -> None:
    if self.enabled:
      if self.bar is not None:
        self.bar.close()
      self.jsonl.close()
      self.tensorboard.close()
