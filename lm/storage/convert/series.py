"""`lm convert --from-hf-series`: a public suite's revisions of one model (Pythia's `step1000`, OLMo's
`step1000-tokens4B`, OLMo 2's `stage1-step1000-tokens5B`) imported as one run, a params-only checkpoint per step.

The source is a folder of revision folders named as the suites name them, or a Hugging Face hub cache folder
(`models--ORG--NAME`: `refs/<revision>` files naming `snapshots/<sha>/`, as `snapshot_download(revision=...)`
leaves it). The run gets the config, the tokenizer and `series.json` (each step's revision and the tokens behind
it); a rerun converts only the revisions that are new. A revision that cannot be read (missing or damaged
weights, `pytorch_model.bin` alone, another model's config) is named in one line and skipped; the others are kept.
"""
from __future__ import annotations

import dataclasses
import json
import re
import sys
from pathlib import Path

from etils import epath

from lm.config import Config, ConfigError, TrainConfig, from_dict
from lm.parallel.mesh import one_device_mesh
from lm.storage.checkpoint import Checkpointer
from lm.storage.convert.hf import INDEX, WEIGHTS, read_hf_config
from lm.storage.run_dir import (CHECKPOINTS, CONFIG, HF_CONFIG, HF_TOKENIZER_FILES, SERIES, TOKENIZER, is_run_dir,
                                read_series)
from lm.storage.source import ModelSource

# anything before `step` (OLMo 2's `stage1-`), the step, then optionally the tokens seen (OLMo: `-tokens4B`)
REVISION = re.compile(r'^(?:.*-)?step(?P<step>\d+)(?:-tokens(?P<tokens>\d+(?:\.\d+)?)(?P<unit>[KMBT]?))?$')
UNITS = {'': 1, 'K': 1e3, 'M': 1e6, 'B': 1e9, 'T': 1e12}
PICKLED = ('pytorch_model.bin', 'pytorch_model.bin.index.json')


@dataclasses.dataclass(frozen=True)
class Revision:
  name: str
  step: int
  tokens: int | None  # from the name (`-tokens4B`) or --tokens-per-step
  path: Path


def parse_revision(name: str) -> tuple[int, int | None] | None:
  """(step, tokens or None) of a revision name, or None when it names no step."""
  match = REVISION.match(name)
  if not match:
    return None
  tokens = match['tokens']
  return int(match['step']), None if tokens is None else round(float(tokens) * UNITS[match['unit']])


def _named(src: Path) -> dict[str, Path]:
  """Revision name -> its folder: a hub cache's refs (`main`, the hub's alias of one of them, left out), else
  the subfolders holding a config.json."""
  refs, snapshots = src / 'refs', src / 'snapshots'
  if refs.is_dir() and snapshots.is_dir():
    named = {}
    for ref in sorted(p for p in refs.rglob('*') if p.is_file()):
      name = ref.relative_to(refs).as_posix()
      if name != 'main':
        named[name] = snapshots / ref.read_text().strip()
    return named
  return {p.name: p for p in sorted(src.iterdir()) if p.is_dir() and (p / 'config.json').is_file()}


def find_revisions(src: str | Path, tokens_per_step: int | None = None) -> list[Revision]:
  """The series' revisions in step order; ConfigError when there are none, one names no step, two name the same
  step or the tokens behind a step are unknown."""
  src = Path(src)
  if not src.is_dir():
    raise ConfigError(f'--from-hf-series {src}: not a directory; pass a folder of revision folders (step1000, ...) '
                      f'or a Hugging Face hub cache folder (models--ORG--NAME)')
  named = _named(src)
  if not named:
    raise ConfigError(f'--from-hf-series {src} holds no revisions: neither revision folders with a config.json '
                      f'(step1000, step1000-tokens4B, ...) nor a hub cache\'s refs/ and snapshots/')
  revisions, steps = [], {}
  for name, path in named.items():
    parsed = parse_revision(Path(name).name)
    if parsed is None:
      raise ConfigError(f'--from-hf-series: revision {name!r} in {src} names no step; name it as the suites do '
                        f'(step1000, step1000-tokens4B, stage1-step1000-tokens5B) or move it out')
    step, tokens = parsed
    if step in steps:
      raise ConfigError(f'--from-hf-series: revisions {steps[step]!r} and {name!r} both name step {step}; convert '
                        f'each stage into a run of its own')
    steps[step] = name
    if tokens_per_step is not None:
      tokens = step * tokens_per_step
    if tokens is None:
      raise ConfigError(f'--from-hf-series: revision {name!r} does not say the tokens behind its step; pass '
                        f'--tokens-per-step N (Pythia: 1024 x 2048 = 2097152)')
    revisions.append(Revision(name, step, tokens, path))
  return sorted(revisions, key=lambda r: r.step)


def _unreadable(revision: Revision) -> str | None:
  """Why a revision's folder cannot be read before opening it, or None."""
  path = revision.path
  if not path.is_dir():
    return f'its snapshot {path} is missing'
  if not (path / WEIGHTS).is_file() and not (path / INDEX).is_file() and any((path / p).is_file() for p in PICKLED):
    return ('it holds only pytorch_model.bin (pickle, which lm never loads); save it with '
            'save_pretrained(dir, safe_serialization=True)')
  return None


def import_hf_series(src: str | Path, run_dir: str | Path, tokens_per_step: int | None = None
                     ) -> tuple[list[Revision], list[Revision], list[tuple[Revision, str]]]:
  """Imports the revisions of `src` that `run_dir` lacks: (converted, already there, skipped with why)."""
  run_dir = epath.Path(run_dir)
  revisions = find_revisions(src, tokens_per_step)
  series = read_series(run_dir)
  if is_run_dir(run_dir) and not series:
    raise ConfigError(f'{run_dir} holds a run that is not an imported series; convert into a new directory')
  if not is_run_dir(run_dir) and (run_dir / CHECKPOINTS).exists():
    raise ConfigError(f'{run_dir} holds checkpoints but no {CONFIG}; convert into a new directory')
  done = [r for r in revisions if str(r.step) in series.get('steps', {})]
  converted, skipped = [], []
  config = from_dict(series['config']) if series else None
  saver = Checkpointer(run_dir / CHECKPOINTS, keep=None, async_save=False, create=False)
  try:
    for revision in [r for r in revisions if r not in done]:
      why = _unreadable(revision)
      try:
        if why is None:
          source = ModelSource(revision.path)
          if config is not None and source.config.model != config.model:
            why = 'its config.json describes another model than the series\' first revision'
          else:
            params = source.params(one_device_mesh())
      except ConfigError as e:  # ours name the file and the fix
        why = str(e)
      except Exception as e:  # a damaged file may raise OSError, safetensors' or JSON's errors, ...
        why = f'{type(e).__name__}: {str(e).splitlines()[0] if str(e) else "unreadable"}'
      if why is not None:
        skipped.append((revision, why))
        print(f'skipped {revision.name}: {why}', file=sys.stderr, flush=True)
        continue
      if config is None:
        config = _start_run(revision, source, run_dir, src)
        series = {'source': str(src), 'config': config.to_dict(), 'steps': {}}
      if revision.step in saver.all_steps():  # saved by a run stopped before it listed the step: written again
        saver.manager.delete(revision.step)
      saver.save_params(revision.step, params, config.to_dict())
      series['steps'][str(revision.step)] = {'revision': revision.name, 'tokens': revision.tokens}
      _write_json(run_dir / SERIES, series)  # after its checkpoint: a listed step is always complete
      converted.append(revision)
      print(f'converted {revision.name}: step {revision.step}, {revision.tokens:,} tokens', flush=True)
  finally:
    saver.close()
  return converted, done, skipped


def _start_run(revision: Revision, source: ModelSource, run_dir: epath.Path, src: str | Path) -> Config:
  """The run's config (the revision's model and tokenizer, `train.init_from` itself), tokenizer and HF config."""
  folder = revision.path
  tokenizer_files = [folder / name for name in HF_TOKENIZER_FILES if (folder / name).is_file()]
  if not tokenizer_files:
    print(f'warning: {folder} holds no tokenizer files ({", ".join(HF_TOKENIZER_FILES)}); the run uses '
          f'data.tokenizer=byte until you set data.tokenizer=hf:PATH', flush=True)
  data = dataclasses.replace(source.config.data, tokenizer=f'hf:{run_dir / TOKENIZER}' if tokenizer_files else 'byte')
  config = from_dict(Config(name=run_dir.name or Path(src).name, model=source.config.model, data=data,
                            train=TrainConfig(run_dir=str(run_dir), init_from=str(run_dir.absolute()))).to_dict())
  run_dir.mkdir(parents=True, exist_ok=True)
  if tokenizer_files:
    (run_dir / TOKENIZER).mkdir(exist_ok=True)
    for file in tokenizer_files:
      epath.Path(file).copy(run_dir / TOKENIZER / file.name, overwrite=True)
  (run_dir / HF_CONFIG).write_text(json.dumps(read_hf_config(folder), indent=2) + '\n')
  (run_dir / CONFIG).write_text(config.to_yaml())
  return config


def _write_json(path: epath.Path, value: dict) -> None:
  """Written whole or not at all: a temporary file renamed over the old one."""
  temporary = path.parent / f'.{path.name}.tmp'
  temporary.write_text(json.dumps(value, indent=2) + '\n')
  temporary.replace(path)
