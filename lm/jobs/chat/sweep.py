"""`lm finetune --task sft|dpo --sweep key=v1,v2 ...`: a grid of chat fine-tunes, each a run dir under
`<run_dir>/sweep/<point>`, compared on their held-out loss. A point whose `result.json` exists is finished: a rerun
skips it, and resumes the one it was stopped in."""
from __future__ import annotations

import json
from typing import Any, Callable

from etils import epath

from lm.config import ConfigError, parse_overrides
from lm.jobs.chat.sft import ChatOptions
from lm.report import format_lines
from lm.storage.run_dir import CHECKPOINTS

RESULT = 'result.json'  # in a point's run dir: its last held-out evaluation
METRIC = 'eval/loss'  # what the sweep compares (lower is better)


def sweep_chat(options: ChatOptions, grid: list[tuple[str, ...]], run: Callable[[ChatOptions], dict | None],
               default_root: str) -> dict[str, Any] | None:
  """Runs `run` on every grid point; returns {'best_point', 'points': label -> metrics} (also written to
  `sweep_results.json`), or None when a SIGTERM stopped it."""
  if options.eval_data is None and not options.eval_fraction:
    raise ConfigError('--sweep compares held-out results: pass --eval-data GLOB or --eval-fraction F')
  root = epath.Path(parse_overrides(list(options.overrides)).get('train', {}).get('run_dir') or default_root) / 'sweep'
  points: dict[str, dict[str, float]] = {}
  for point in grid:
    label = ','.join(item.split('.')[-1] for item in point)
    done = root / label / RESULT
    if done.exists():
      print(f'{label}: done, skipped', flush=True)
      points[label] = json.loads(done.read_text())
      continue
    resume = ('train.resume=true',) if (root / label / CHECKPOINTS).exists() else ()
    result = run(ChatOptions(**{**options.__dict__, 'overrides': (*options.overrides, *point, *resume,
                                                                   f'train.run_dir={root / label}')}))
    if result is None:
      return None
    done.write_text(json.dumps(result, indent=2) + '\n')
    points[label] = result
  best = min(points, key=lambda label: points[label][METRIC])
  report = {'metric': METRIC, 'best_point': best, 'points': points}
  (root / 'sweep_results.json').write_text(json.dumps(report, indent=2) + '\n')
  print(format_lines([(label, ', '.join(f'{k} {v:.4f}' for k, v in metrics.items() if k.startswith('eval/')) +
                       (' (best)' if label == best else '')) for label, metrics in points.items()]), flush=True)
  return report
