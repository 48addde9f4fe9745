"""`lm eval`: a checkpoint (our run dir, or an HF model directory) on lm-eval-harness tasks.

Writes `<out>/results.json` (per task: the harness's metrics with their standard errors, n, shots and version,
plus the sha256 of every local data file read) and `<out>/<task>.jsonl` (per example: doc id, per-request
log-likelihood and greedy flag in choice order, prediction, gold); `<out>` defaults to `RUN/eval/step_<S>`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lm.config import ConfigError, parse_overrides
from lm.storage.source import open_model

DEFAULT_BATCH = 32
SUBSET_SEED = 0


@dataclasses.dataclass(frozen=True)
class Request:
  """What to evaluate: harness task names, where their data lives, and the harness's settings."""
  tasks: tuple[str, ...]
  data_dir: Path | str | None = None  # local task files; with source 'tfds', TFDS's data dir (may be gs://)
  source: str = 'files'  # files (data_dir's, else the Hub's) | tfds (prepared TFDS datasets)
  num_fewshot: int | None = None  # None: each task's own default
  limit: int | None = None  # the first N documents of each task
  subset: int | None = None  # N documents of each task drawn with SUBSET_SEED (the same N in every run)
  max_length: int | None = None  # None: the model's context
  batch_size: int = DEFAULT_BATCH


def load_checkpoint(path: str | Path, step: int | None = None, overrides: Sequence[str] = (), ema: bool = False
                    ) -> tuple[Any, Any, int]:
  """(assembly, params, step) of a run dir's checkpoint `step` (default: the latest; `ema`: its params' moving
  average) or an HF directory's weights (step 0), laid out over every device (`mesh.*` overrides choose how)."""
  if set(parse_overrides(list(overrides))) - {'mesh'}:
    raise ConfigError(f'lm eval takes mesh.* overrides only (e.g. mesh.fsdp=4); got {", ".join(overrides)}')
  source, assembly, params = open_model(path, step=step, ema=ema, flag='--model', overrides=tuple(overrides))
  return assembly, params, source.step


def check_installed() -> None:
  import importlib.util
  if importlib.util.find_spec('lm_eval') is None:
    raise ConfigError("lm eval needs lm-eval-harness: pip install -e '.[eval]'")


@contextlib.contextmanager
def harness_output() -> Iterator[None]:
  """The harness's chatter (progress bars, its dataset builds, `git describe`, bootstrap notes) held back, and
  shown only when it fails unexplained (not on a ConfigError's one line): the process's stdout and stderr and
  Python's `sys.stdout`/`sys.stderr` (which a host such as pytest may have replaced) all go to one file. Its
  bootstrap runs in this process: a forked pool would copy JAX's threads."""
  for key in ('DISABLE_MULTIPROC', 'TQDM_DISABLE', 'HF_DATASETS_DISABLE_PROGRESS_BARS'):
    os.environ.setdefault(key, '1')
  sys.stdout.flush()
  sys.stderr.flush()
  saved = {fd: os.dup(fd) for fd in (1, 2)}
  with tempfile.TemporaryFile() as held:
    stream = open(held.fileno(), 'w', encoding='utf-8', errors='replace', closefd=False)  # noqa: SIM115
    for fd in saved:
      os.dup2(held.fileno(), fd)
    failed = True
    try:
      with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
        yield
      failed = False
    except ConfigError:
      failed = False
      raise
    finally:
      stream.close()
      for fd, copy in saved.items():
        os.dup2(copy, fd)
        os.close(copy)
      if failed:
        held.seek(0)
        sys.stderr.write(held.read().decode(errors='replace'))


def subset_indices(size: int, count: int) -> list[int]:
  """`count` of a task's `size` documents, drawn with SUBSET_SEED, in document order (all when count >= size)."""
  rng = np.random.default_rng(SUBSET_SEED)
  return sorted(int(i) for i in rng.choice(size, size=min(count, size), replace=False))


class TaskEvaluator:
  """The harness's evaluation of `request` with one assembly's model, for any params of it (a checkpoint's, or
  the training state's in the loop): the tasks are resolved, their local configs written and the subsets drawn
  once; the engine's programs compile on the first call."""

  def __init__(self, assembly: Any, request: Request):
    check_installed()
    if request.data_dir is not None or request.source == 'tfds':  # no download; a clear error where data falls short
      os.environ.setdefault('HF_DATASETS_OFFLINE', '1')
      os.environ.setdefault('HF_HUB_OFFLINE', '1')
    from lm.data.tokenizers import get_tokenizer
    from lm.jobs.evals.engine import HarnessLM
    from lm.jobs.evals.tasks import installed_task, local_tasks, task_manager
    cfg = assembly.config
    if assembly.family.decoding is None:
      raise ConfigError(f'model.family={cfg.model.family!r} is not a generative model: lm eval scores continuations '
                        f'with a decoder-only or encoder-decoder model')
    max_length = request.max_length or cfg.model.max_len
    if request.max_length is not None and not 1 < request.max_length <= cfg.model.max_len:
      raise ConfigError(f'--max-length {request.max_length} must lie in [2, model.max_len={cfg.model.max_len}]')
    self.request, self.manager = request, task_manager()
    self._configs = tempfile.TemporaryDirectory()  # the local task configs, for this evaluator's life
    own = [Path(t) for t in request.tasks if t.endswith(('.yaml', '.yml'))]  # a researcher's task files
    for path in own:
      if not path.is_file():
        raise ConfigError(f'--tasks {path}: no such task file (a harness task YAML)')
    names = [t for t in request.tasks if not t.endswith(('.yaml', '.yml'))]
    if request.data_dir is None and request.source != 'tfds':
      specs = {t: installed_task(self.manager, t).name for t in names}
      self.files = own
    else:
      self.files = own + local_tasks(self.manager, names, request.data_dir, Path(self._configs.name), request.source)
      specs = {t: str(Path(self._configs.name) / f'{t}.yaml') for t in names}
    self.specs = [specs.get(t) or str(Path(t).resolve()) for t in request.tasks]
    self.model = HarnessLM(assembly, None, get_tokenizer(cfg.data.tokenizer), batch_size=request.batch_size,
                           max_length=max_length)
    self.samples = None if request.subset is None else self._draw(request.subset)

  def _draw(self, count: int) -> dict[str, list[int]]:
    """Each task's subset of `count` documents (a group's member tasks each get their own)."""
    with harness_output():
      tasks = self.manager.load(self.specs)['tasks']
    return {name: subset_indices(len(task.eval_docs), count) for name, task in tasks.items()}

  def __call__(self, params: Any) -> dict[str, Any]:
    """The harness's results dict (`lm_eval.simple_evaluate`, samples logged), plus 'data_files' (path -> sha256
    of each local file read)."""
    import lm_eval

    from lm.jobs.evals.tasks import sha256
    self.model.set_params(params)
    with harness_output():
      try:
        results = lm_eval.simple_evaluate(model=self.model, tasks=self.specs, num_fewshot=self.request.num_fewshot,
                                          limit=self.request.limit, samples=self.samples, task_manager=self.manager,
                                          log_samples=True)
      except ValueError as e:
        raise too_few_shots(e, self.request.num_fewshot) or e
    results['data_files'] = {str(f): sha256(f) for f in self.files}
    return results


def too_few_shots(error: ValueError, shots: int | None) -> ConfigError | None:
  """The one-line error for the harness's few-shot sampler asking more documents than its task's few-shot split
  holds (`random.sample`'s ValueError, raised while the task builds its requests), naming the task."""
  import traceback

  from lm_eval.api.task import Task
  if 'larger than population' not in str(error):
    return None
  tasks = [f.f_locals['self'] for f, _ in traceback.walk_tb(error.__traceback__)
           if isinstance(f.f_locals.get('self'), Task)]
  if not tasks:
    return None
  task = tasks[-1]
  return ConfigError(f'--num-fewshot {shots}: {task.config.task} draws its few-shot examples from '
                     f'{len(task.fewshot_docs())} documents (one fewer where they are the evaluated split); '
                     f'lower --num-fewshot or give it a larger few-shot split')


def evaluate(assembly: Any, params: Any, request: Request) -> dict[str, Any]:
  """The harness's results for `request` on these params (see TaskEvaluator)."""
  return TaskEvaluator(assembly, request)(params)


def metric_records(results: dict[str, Any]) -> dict[str, float]:
  """`eval/<task>/<metric>` of every numeric metric (standard errors left out) and the task loss, for
  metrics.jsonl."""
  return {f'eval/{task}/{name}': float(value) for task, entry in summary(results)['tasks'].items()
          for name, value in [*entry['metrics'].items(), ('task_loss', entry.get('task_loss'))]
          if isinstance(value, (int, float))}


def summary(results: dict[str, Any]) -> dict[str, Any]:
  """results.json: per task the harness's metrics (its filter suffix ',none' dropped) and their standard errors,
  n, shots and version; the data files' sha256."""
  tasks = {}
  for task, values in results['results'].items():
    metrics, stderr = {}, {}
    for key, value in values.items():
      if ',' not in key:
        continue
      name, filt = key.split(',', 1)
      name = name if filt == 'none' else f'{name},{filt}'
      if name.endswith('_stderr'):
        stderr[name.removesuffix('_stderr')] = value
      else:
        metrics[name] = value
    tasks[task] = {'metrics': metrics, 'stderr': stderr, 'n': results['n-samples'][task]['effective'],
                   'shots': results['n-shot'][task], 'version': results['versions'][task]}
    loss = task_loss(results.get('samples', {}).get(task, []))
    if loss is not None:
      tasks[task]['task_loss'] = loss
  return {'tasks': tasks, 'data_files': results['data_files']}


def task_loss(samples: Sequence[dict[str, Any]]) -> float | None:
  """The task loss of Bhagia et al. 2024 (what a ladder fits before mapping it to accuracy): the mean over
  documents of the correct continuation's negative log-likelihood per UTF-8 byte of it, in nats. None where the
  task scores no continuations (generative, rolling) or its gold answer is no choice index."""
  losses = []
  for sample, record in zip(sorted(samples, key=lambda s: s['doc_id']), example_records(samples)):
    gold = record['gold'] if len(sample['arguments']) > 1 else 0
    if 'loglikelihood' not in record or isinstance(gold, bool) or not isinstance(gold, int):
      return None
    continuation = sample['arguments'][gold][1]
    losses.append(-record['loglikelihood'][gold] / max(len(continuation.encode()), 1))
  return float(np.mean(losses)) if losses else None


def example_records(samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per example: doc id, per-request (log-likelihood, greedy) in choice order (or the generated text), the
  prediction (argmax of the log-likelihoods) and the gold answer."""
  records = []
  for sample in sorted(samples, key=lambda s: s['doc_id']):
    responses = [r[0] if isinstance(r, list) and len(r) == 1 else r for r in sample['filtered_resps']]
    record: dict[str, Any] = {'doc_id': sample['doc_id'], 'gold': sample['target']}
    if responses and all(isinstance(r, (list, tuple)) and len(r) == 2 for r in responses):
      record['loglikelihood'] = [float(r[0]) for r in responses]
      record['greedy'] = [bool(r[1]) for r in responses]
      record['prediction'] = max(range(len(responses)), key=lambda i: record['loglikelihood'][i])
    else:
      record['output'] = responses
    records.append(record)
  return records


def write_results(results: dict[str, Any], out: Path) -> None:
  out.mkdir(parents=True, exist_ok=True)
  (out / 'results.json').write_text(json.dumps(summary(results), indent=2, default=str) + '\n')
  for task, samples in results.get('samples', {}).items():
    with open(out / f'{task}.jsonl', 'w') as f:
      f.writelines(json.dumps(record, default=str) + '\n' for record in example_records(samples))


def run(path: str | Path, request: Request, *, step: int | None = None, out: str | Path | None = None,
        overrides: Sequence[str] = (), ema: bool = False) -> tuple[dict[str, Any], Path]:
  """`lm eval`: evaluates (`ema`: the params' moving average), writes the outputs (the main process); returns the
  harness's results and where the outputs went (default RUN/eval/step_<S>, or step_<S>_ema)."""
  from lm.distributed import is_main_process
  check_installed()
  if request.source not in ('files', 'tfds'):
    raise ConfigError(f'--source {request.source} is not a task data source; choose files or tfds')
  if request.source == 'files' and request.data_dir is not None and not Path(request.data_dir).is_dir():
    raise ConfigError(f'--data-dir {request.data_dir} is not a directory')
  assembly, params, step = load_checkpoint(path, step, overrides, ema)
  results = evaluate(assembly, params, request)
  out = Path(out) if out else Path(path) / 'eval' / (f'step_{step}_ema' if ema else f'step_{step}')
  if is_main_process():
    write_results(results, out)
  return results, out
