"""Where a run's records go besides metrics.jsonl (`train.trackers`): TensorBoard event files in RUN/tensorboard
(the default) and a Weights & Biases run.

The W&B run's id is kept in RUN/wandb_run.json, so `--resume` continues the same run and history: the steps a
resumed run redoes after its checkpoint were logged before the crash, and are not sent twice. A branch
(`train.branch_from`) starts a new W&B run whose config and notes name the source run and step. The config and
tags go to the run at its start, `lm report`'s summary at its end. W&B never stops training: a failure to reach
it, or to log, is one warning line and the run goes on without it.
"""
from __future__ import annotations

import json
import math
import os
import struct
import sys
import tempfile
import uuid
from typing import Any, Protocol

from etils import epath

from lm.config import Config, ConfigError

TENSORBOARD = 'tensorboard'
WANDB_RUN = 'wandb_run.json'
INIT_TIMEOUT_SECONDS = 60  # W&B's own default is 90 s: the run waits this long for an unreachable service


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


class Tracker(Protocol):
  def backfill(self, records: list[dict[str, Any]]) -> None:
    """At a resume: the records kept in metrics.jsonl (up to the step resumed from) the tracker may lack."""
  def log(self, record: dict[str, Any]) -> None: ...
  def close(self, summary: dict[str, float]) -> None:
    """At the end: `summary` (lm report's figures) goes where the tracker keeps one."""



def is_local(path: epath.Path) -> bool:
  return '://' not in str(path)


def numbers(record: dict[str, Any]) -> dict[str, float]:
  """A record's finite numbers but its step (metrics.jsonl writes the others as null)."""
  return {k: v for k, v in record.items() if k != 'step' and isinstance(v, (int, float)) and math.isfinite(v)}


class TensorBoard:
  """Event files in RUN/tensorboard; a remote run dir's are written locally and copied up at the end."""

  def __init__(self, run_dir: epath.Path):
    events = run_dir / TENSORBOARD
    self.remote = None if is_local(run_dir) else events
    self.writer = SummaryWriter(str(events) if self.remote is None else tempfile.mkdtemp(prefix='lm_tensorboard_'))

  def backfill(self, records: list[dict[str, Any]]) -> None:
    """Nothing: event files keep what was flushed, and TensorBoard shows the latest value of a step written twice."""

  def log(self, record: dict[str, Any]) -> None:
    for key, value in record.items():
      if key != 'step' and isinstance(value, (int, float)):
        self.writer.add_scalar(key, value, record['step'])

  def close(self, summary: dict[str, float] | None = None) -> None:
    self.writer.close()
    if self.remote is not None:  # copy the local event files up
      self.remote.mkdir(parents=True, exist_ok=True)
      for event_file in epath.Path(self.writer.logdir).iterdir():
        event_file.copy(self.remote / event_file.name, overwrite=True)


def warn(what: str, error: BaseException) -> None:
  print(f'wandb: {what} failed ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ""}); '
        f'training goes on without W&B', file=sys.stderr, flush=True)


class WandB:
  """One W&B run per lm run, continued by --resume. What its history already holds is read back at the start (the
  server's next step online; offline, the run's own transaction logs under RUN/wandb, since a killed process's
  last records may never have been written): the records of metrics.jsonl past that are sent first (`backfill`),
  and a step the history holds is never sent again."""

  def __init__(self, run_dir: epath.Path, config: Config):
    import wandb
    self.run_dir, self.run = run_dir, None
    self.step, self.open = -1, False  # the history's last step, and whether its row takes more records
    saved = run_dir / WANDB_RUN
    w = config.train.wandb
    resuming = config.train.resume and saved.exists()
    run_id = json.loads(saved.read_text())['id'] if resuming else uuid.uuid4().hex[:8]
    source = branch_source(config)
    notes = None if source is None else f'branched from {source["run_dir"]} at step {source["step"]}'
    timeout = {} if 'WANDB_INIT_TIMEOUT' in os.environ else {'init_timeout': INIT_TIMEOUT_SECONDS}
    try:
      wandb.setup(wandb.Settings(silent=True))  # W&B's own lines (the key it loaded, sync hints) stay out of the log
      self.run = wandb.init(project=w.project, entity=w.entity, id=run_id, resume='allow' if resuming else None,
                            name=config.name, tags=list(w.tags), notes=notes,
                            config={**config.to_dict(), **({'branched_from': source} if source else {})},
                            dir=str(run_dir) if is_local(run_dir) else None, reinit='create_new',
                            settings=wandb.Settings(console='off', silent=True, **timeout))
      if resuming:
        self.step = max(offline_steps(run_dir, run_id), default=-1) if self.run.offline else self.run.step - 1
    except Exception as e:  # unreachable service, bad key, bad entity: none may stop training
      warn('starting the run', e)
      return
    saved.write_text(json.dumps({'id': run_id, 'project': w.project, 'entity': w.entity}))

  def backfill(self, records: list[dict[str, Any]]) -> None:
    """The records (metrics.jsonl's, up to the step resumed from) that the history lacks."""
    for record in records:
      if record['step'] > self.step or (record['step'] == self.step and self.open):
        self.log(record)

  def log(self, record: dict[str, Any]) -> None:
    """Sends a record of a new step, or one more of the step just sent; a step the history holds already (redone
    after a resume or a rollback) is not sent again."""
    step = record['step']
    if step > self.step:
      self.step, self.open = step, True
    elif step < self.step or not self.open:
      self.open = False
      return
    if self.run is None:
      return
    try:
      self.run.log(numbers(record), step=step)
    except Exception as e:
      warn('logging', e)
      self.run = None

  def close(self, summary: dict[str, float] | None = None) -> None:
    if self.run is None:
      return
    try:
      self.run.summary.update(summary or {})
      self.run.finish()
    except Exception as e:
      warn('finishing the run', e)


def transaction_log(path: epath.Path) -> list[Any]:
  """The records (`wandb_internal_pb2.Record`) of a W&B transaction log, RUN/wandb/*/run-ID.wandb: LevelDB's log
  format, 32 KiB blocks of chunks with a 7-byte header of CRC, length and type FULL 1, FIRST 2, MIDDLE 3, LAST 4,
  after the file's own 7-byte header. A killed process's may hold nothing but that header."""
  from wandb.proto import wandb_internal_pb2
  data, block, pos, chunk, records = path.read_bytes(), 32768, 7, b'', []
  while pos + 7 <= len(data):
    if block - pos % block < 7:  # a block's tail too short for a header is padding
      pos += block - pos % block
      continue
    _, length, kind = struct.unpack('<IHB', data[pos:pos + 7])
    chunk += data[pos + 7:pos + 7 + length]
    pos += 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(chunk)
      records.append(record)
      chunk = b''
  return records


def offline_steps(run_dir: epath.Path, run_id: str) -> set[int]:
  """The steps the offline W&B run `run_id` holds: the history records of its transaction logs."""
  return {int(item.value_json) for path in (run_dir / 'wandb').glob(f'offline-run-*-{run_id}/run-{run_id}.wandb')
          for record in transaction_log(path) if record.WhichOneof('record_type') == 'history'
          for item in record.history.item if item.key == '_step'}


def branch_source(config: Config) -> dict[str, Any] | None:
  """The run and step a branch starts from, with the source's W&B run id where it had one."""
  if config.train.branch_from is None:
    return None
  checkpoint = epath.Path(config.train.branch_from)
  source_dir = checkpoint.parent.parent
  saved = source_dir / WANDB_RUN
  return {'run_dir': str(source_dir), 'step': int(checkpoint.name),
          'wandb_id': json.loads(saved.read_text())['id'] if saved.exists() else None}


def check_trackers(config: Config) -> None:
  if 'wandb' in config.train.trackers:
    try:
      import wandb  # noqa: F401
    except ImportError:
      raise ConfigError('train.trackers names wandb, which is not installed; pip install wandb (the wandb extra '
                        'of lm), or drop it from train.trackers') from None


def make_trackers(config: Config, run_dir: epath.Path, kept: list[dict[str, Any]]) -> list[Tracker]:
  """The trackers `train.trackers` names, each given the records kept in metrics.jsonl (a resumed run's, up to the
  step it resumes from) that it may lack."""
  check_trackers(config)
  trackers = [TensorBoard(run_dir) if name == 'tensorboard' else WandB(run_dir, config)
              for name in config.train.trackers]
  for tracker in trackers:
    tracker.backfill(kept)
  return trackers
