"""Orbax checkpoints in one layout for every run, restorable onto any mesh.

Each step directory holds the items `params` and `config`; a training checkpoint adds
`optimizer` (step and optimizer state) and `data` (the grain iterator's position, one JSON file
per process, so every host resumes at its exact record). An imported model
(`lm convert --from-hf`) writes params and config only, so every command that reads params
reads both alike. A LoRA run's checkpoints hold the params it trains and a `base` item naming where the rest is
(lm.storage.lora_base); every restore here puts them back together.
"""
from __future__ import annotations

import contextlib
import errno
import gc
import inspect
import logging
import re
import sys
from collections.abc import Callable
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath

from lm.assembly.state import TrainState, shardings_of
from lm.config import Config, ConfigError, merge, upgrade
from lm.distributed import all_processes, barrier
from lm.models.transformer import relayout
from lm.storage import lora_base

UNRESTORABLE = '.unrestorable'  # suffix of a checkpoint set aside because it did not restore
SPIKE_WINDOW = 'spike_window'  # the item of train.on_spike's window, in checkpoints of runs that keep one

# Orbax saves a replicated array as 1/R slices, one per replica, so that R devices (and hosts) share the write;
# each slice shape is one more device program to compile. Below a few MiB per slice (norms, biases, every array
# of a small model) that costs more than it spreads: those arrays are written whole from one replica.
REPLICA_PARALLEL_MIN_SLICE_BYTES = 4 << 20


@contextlib.contextmanager
def _absl_quiet():
  """Orbax logs a warning (through absl, on every run's stderr) for any handler that replaces its own."""
  absl, level = logging.getLogger('absl'), logging.getLogger('absl').level
  absl.setLevel(logging.ERROR)
  try:
    yield
  finally:
    absl.setLevel(level)


with _absl_quiet():
  ocp.type_handlers.register_type_handler(
    jax.Array, ocp.type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_SLICE_BYTES),
    override=True)


_ORDER_FREE = frozenset({'prefetch', 'evals'})  # data settings that change speed or evaluation, not which rows come


def _reason(error: BaseException | None) -> str:
  """The first sentence of a restore error, without TensorStore's spec dump."""
  if error is None:
    return 'it fails on another process'
  text = str(error).split(' See full TensorStore details')[0].splitlines()[0]
  return text if len(text) <= 160 else text[:157] + '...'


def _drop_abandoned_io_reports() -> None:
  """A failed restore or save abandons orbax's reads or writes: their coroutines are collected, and TensorStore's
  threads finish them whenever they do, each then calling back into orbax's closed event loop. Python would print
  a traceback for every such coroutine, task and callback (dozens or thousands, after the one line that names the
  checkpoint), and orbax logs each failed write: those reports are dropped and every other one is passed on."""
  previous = sys.unraisablehook
  if getattr(previous, 'drops_abandoned_reads', False):
    return

  def hook(unraisable):
    obj, error = unraisable.object, unraisable.exc_value
    abandoned = inspect.iscoroutine(obj) and 'orbax' in obj.cr_code.co_filename
    closed_loop = obj is None and isinstance(error, RuntimeError) and str(error) == 'Event loop is closed'
    if not (abandoned or closed_loop):
      previous(unraisable)
  hook.drops_abandoned_reads = True
  sys.unraisablehook = hook
  # A read task, or a save's gathered writes, collected before anyone awaited them is logged by asyncio instead
  # (when the timing has it so: 'Task exception ...', '_GatheringFuture exception was never retrieved').
  logging.getLogger('asyncio').addFilter(lambda record: not (
    'exception was never retrieved' in record.getMessage() and 'orbax' in record.getMessage()))
  # the failure a save's background threads met, logged by orbax (with tracebacks) as it reaches the caller
  # (Checkpointer._write), which names it in one line
  logging.getLogger('absl').addFilter(lambda record: not any(
    failed in record.getMessage() for failed in SAVE_FAILURE_LOGS))


SAVE_FAILURE_LOGS = ('_SignalingThread.run() raised an exception', 'Handler Commit operations or the Commit callback',
                     'Save Finalize thread (save_finalize) failed')


class CheckpointWriteError(RuntimeError):
  """A checkpoint could not be written (a full disk, a lost bucket); the message says which, why and what next."""


def _write_reason(error: BaseException, directory: epath.Path) -> str:
  """Why a write failed, in a few words: the OS error TensorStore or Python met, else the error's first line."""
  text = str(error)
  if 'No space left on device' in text or getattr(error, 'errno', None) == errno.ENOSPC:
    return f'no space left on the device holding {directory}'
  found = re.search(r"Failed to write [^:]*: (.*?) \[os_error_code", text)
  return f'{found[1]} under {directory}' if found else _reason(error)


def with_defaults(saved: dict) -> dict:
  """A checkpoint's config sections in today's spelling (`upgrade`), a field added since it was written taking its
  default (it was written so)."""
  saved = upgrade(saved)
  return {section: merge(default, saved.get(section, {}))
          for section, default in Config().to_dict().items() if isinstance(default, dict)}


def _flat(section: dict, prefix: str = '') -> dict[str, Any]:
  """A config section's fields by dotted name, its groups' fields included (`rope.factor`)."""
  out: dict[str, Any] = {}
  for key, value in section.items():
    out.update(_flat(value, f'{prefix}{key}.') if isinstance(value, dict) else {f'{prefix}{key}': value})
  return out


def config_mismatch(saved: dict, config: dict) -> tuple[str, list[str]] | None:
  """What a run continuing a checkpoint written under `saved` (with_defaults) must share with it and does not:
  (the model | data order | seed or moving average | optimizer and its param groups, the differing fields), or
  None."""
  for section, keys, what in (('model', None, 'model'), ('data', None, 'data order'),
                              ('train', ('seed', 'ema_decay'), 'seed or moving average'),
                              ('optim', ('name', 'lr_multipliers'), 'optimizer')):
    theirs, ours = _flat(saved[section]), _flat(config[section])
    free = lambda k: k in _ORDER_FREE or k.startswith('execution.')  # how the step computes may change
    keys = keys or sorted(k for k in set(theirs) | set(ours) if not free(k))
    diff = [f'{section}.{k}' for k in keys if theirs.get(k) != ours.get(k)]
    if diff:
      return what, diff
  return None


# Orbax warns, on every array of every save, that it keeps no global size statistic for a process-local write.
logging.getLogger('absl').addFilter(lambda record: 'Global object size logging disabled' not in record.getMessage())


def _process_local() -> tuple[dict[str, Any], dict[str, Any]]:
  """The manager options and item handlers of a checkpoint of this process's shards alone, in a directory of its
  own (the local tier, as orbax's emergency checkpointing writes it): the process is its own primary, writes every
  shard it holds (no replica chosen) and meets no other process at a barrier. It creates its directories before
  writing: orbax's asynchronous creation signals completion under a key every process shares, so one process's
  signal would release another's writes early."""
  me = jax.process_index()
  options = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={me},
                                               barrier_sync_key_prefix=f'local_{me}')
  registry = ocp.type_handlers.create_type_handler_registry(
    (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)))
  tree = lambda: ocp.PyTreeCheckpointHandler(multiprocessing_options=options, type_handler_registry=registry)
  json = lambda: ocp.JsonCheckpointHandler(multiprocessing_options=options)
  handlers = {'params': tree(), 'optimizer': tree(), SPIKE_WINDOW: tree(), 'data': grain.checkpoint.CheckpointHandler(),
              'config': json(), lora_base.BASE: json()}
  return {'multiprocessing_options': options, 'cleanup_tmp_directories': True,
          'async_options': ocp.options.AsyncOptions(create_directories_asynchronously=False)}, handlers


class Checkpointer:
  """Async saves every N steps keeping the last K; restore reshards onto the abstract state's shardings."""

  def __init__(self, directory: str | epath.PathLike, keep: int | None = 1, async_save: bool = True,
               create: bool = True, keep_steps: tuple[int, ...] = (), keep_every: int = 0,
               process_local: bool = False):
    """`create=False`: a missing directory holds no steps, and is made by the first save; `keep_steps` and the
    multiples of `keep_every` (> 0) are kept besides the latest `keep`. `process_local`: this process's shards and
    data position only, in a directory no other process writes (a local checkpoint tier); it restores only onto the
    shardings that wrote it, in as many processes."""
    self.directory = epath.Path(directory)
    if '://' not in str(self.directory):
      self.directory = self.directory.absolute()
    managers = ocp.checkpoint_managers
    kept = ([managers.CustomSteps(keep_steps)] if keep_steps else []) + \
        ([managers.EveryNSteps(keep_every)] if keep_every else [])
    policy = managers.AnyPreservationPolicy([managers.LatestN(keep), *kept]) if kept else None
    local_options, self._handlers = _process_local() if process_local else ({}, None)
    self.options = ocp.CheckpointManagerOptions(max_to_keep=None if policy else keep, preservation_policy=policy,
                                                create=create, enable_async_checkpointing=async_save,
                                                **local_options)
    self.manager = self._manager()
    self._base: dict | None = None  # the base item of a LoRA run's checkpoints, as first written or read

  def _manager(self) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(self.directory, options=self.options, item_handlers=self._handlers)

  def _save(self, tree: Any) -> ocp.args.CheckpointArgs:
    return ocp.args.StandardSave(tree) if self._handlers is None else ocp.args.PyTreeSave(tree)

  def _restore(self, abstract: Any) -> ocp.args.CheckpointArgs:
    if self._handlers is None:
      return ocp.args.StandardRestore(abstract)
    return ocp.args.PyTreeRestore(abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state: TrainState, data: Any, config: dict) -> None:
    """`data`: a grain iterator, or any object with get_state() -> bytes and set_state(bytes)."""
    window = {} if state.spike_window is None else {SPIKE_WINDOW: self._save(state.spike_window)}
    params, base = self._stored(state.params, config)
    self._write(step, lambda: self.manager.save(step, args=ocp.args.Composite(
      params=self._save(params), **base,
      optimizer=self._save({'step': state.step, 'opt_state': state.opt_state, 'skipped': state.skipped}),
      data=grain.checkpoint.CheckpointSave(data), config=ocp.args.JsonSave(config), **window), force=True))

  def _stored(self, params: Any, config: dict) -> tuple[Any, dict[str, ocp.args.CheckpointArgs]]:
    """(the params a checkpoint of a run under `config` holds, its base item if a LoRA base is left out)."""
    mask = lora_base.left_to_base(params, config)
    if mask is None:
      return params, {}
    if self._base is None:  # the base never moves: named once, or as the checkpoint resumed from names it
      self._base = lora_base.identify(config)
    return lora_base.trained(params, mask), {lora_base.BASE: ocp.args.JsonSave(self._base)}

  def _over_base(self, step: int, abstract_params: Any) -> tuple[Any, Callable[[Any], Any]]:
    """(what to read of checkpoint `step`'s params, the function completing them): when it left a LoRA base out,
    the trained params and the base read from its source; else the params as they are."""
    if not (self.directory / str(step) / lora_base.BASE).exists():
      return abstract_params, lambda params: params
    saved = with_defaults(self.saved_config(step))
    base = self.manager.restore(step, args=ocp.args.Composite(**{lora_base.BASE: ocp.args.JsonRestore()}))
    self._base = base = base[lora_base.BASE]
    mask = lora_base.left_to_base(abstract_params, saved)
    scanned = saved['model']['execution']['scan_layers']
    return lora_base.trained(abstract_params, mask), \
        lambda params: lora_base.filled(params, base, abstract_params, mask, scanned)

  def _write(self, step: int | None, write: Any) -> None:
    """Runs `write` (a save, which first waits for the previous one, or the wait), turning a failed write of this
    or the previous asynchronous save into one CheckpointWriteError: the step, why, the last complete checkpoint
    and what to do. The failed save's partial files (its orbax temporary directory) are removed: they only take
    space, and the next save or a resume never reads them."""
    _drop_abandoned_io_reports()  # a failed write's callbacks come as soon as it fails
    try:
      write()
    except Exception as e:  # TensorStore, orbax and the OS raise many kinds
      partial = sorted(self.directory.glob('*.orbax-checkpoint-tmp*')) if self.directory.exists() else []
      failed = partial[0].name.split('.')[0] if partial else step
      for path in partial:
        path.rmtree(missing_ok=True)
      complete = sorted(int(p.name) for p in self.directory.iterdir() if p.name.isdigit()) \
        if self.directory.exists() else []
      last = f'{self.directory}/{complete[-1]}' if complete else 'none'
      raise CheckpointWriteError(
        f'checkpoint {failed} was not written: {_write_reason(e, self.directory)}; the last complete checkpoint is '
        f'{last}; free space (or lower train.checkpoint.keep), then continue with --resume') from e

  def save_params(self, step: int, params: Any, config: dict, metrics: dict[str, float] | None = None,
                  over_base: bool = False) -> None:
    """A params-only checkpoint (an imported model, a fine-tune's best params, with the `metrics` that made them
    best): no optimizer state or data position. `over_base`: a trained run's, leaving a LoRA base to its source."""
    params, base = self._stored(params, config) if over_base else (params, {})
    items = {'params': self._save(params), 'config': ocp.args.JsonSave(config), **base}
    if metrics is not None:
      items['metrics'] = ocp.args.JsonSave(metrics)
    self._write(step, lambda: self.manager.save(step, args=ocp.args.Composite(**items), force=True))

  def saved_metrics(self, step: int) -> dict[str, float]:
    return self.manager.restore(step, args=ocp.args.Composite(metrics=ocp.args.JsonRestore()))['metrics']

  def delete_all(self) -> None:
    for step in self.all_steps():
      self.manager.delete(step)

  def saved_config(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))['config']

  def has_optimizer(self, step: int) -> bool:
    return (self.directory / str(step) / 'optimizer').is_dir()

  def is_params_only(self) -> bool:
    """Whether every checkpoint holds params alone (an imported model: nothing to resume)."""
    steps = self.all_steps()
    return bool(steps) and not any(self.has_optimizer(s) for s in steps)

  def restore(self, step: int, abstract_state: TrainState, config: dict, data: Any) -> TrainState:
    """State placed on `abstract_state`'s shardings, after checking the model matches; `data` is moved to the
    saved position in place. `model.execution` may differ: the params are converted to this
    run's layer layout when `model.execution.scan_layers` changed, and one line on stdout says what changed."""
    saved = with_defaults(self.saved_config(step))
    mismatch = config_mismatch(saved, config)
    if mismatch:
      what, fields = mismatch
      raise ConfigError(f'checkpoint {self.directory}/{step} was written for a different {what} (differs in '
                        f'{", ".join(fields)}); resume with the same settings or start a new train.run_dir')
    if not self.has_optimizer(step):
      raise ConfigError(f'checkpoint {self.directory}/{step} holds params only (an imported model), nothing to '
                        f'resume; start a new run from it with train.init_from={self.directory.parent}')
    scanned = config['model']['execution']['scan_layers']
    saved_scanned = saved['model']['execution']['scan_layers']
    a = abstract_state if saved_scanned == scanned else relayout(abstract_state, saved_scanned)
    # the spike guard's window where this run keeps one and the checkpoint has it (else the run starts a fresh one)
    window = {SPIKE_WINDOW: self._restore(a.spike_window)} \
      if a.spike_window is not None and (self.directory / str(step) / SPIKE_WINDOW).is_dir() else {}
    read, complete = self._over_base(step, a.params)
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
        params=self._restore(read),
        optimizer=self._restore({'step': a.step, 'opt_state': a.opt_state, 'skipped': a.skipped}),
        data=grain.checkpoint.CheckpointRestore(data), **window))
    except ValueError as e:
      if 'process_' not in str(e):
        raise
      raise ConfigError(f'checkpoint {self.directory}/{step} holds no data position for this process '
                        f'({jax.process_index()} of {jax.process_count()}); resume with as many processes as '
                        f'wrote it') from None
    optimizer = restored['optimizer']
    state = TrainState(step=optimizer['step'], params=complete(restored['params']), opt_state=optimizer['opt_state'],
                       skipped=optimizer['skipped'], spike_window=restored[SPIKE_WINDOW] if window else None)
    if saved_scanned != scanned:
      state = jax.jit(lambda s: relayout(s, scanned), out_shardings=shardings_of(abstract_state))(state)
    show = lambda v: str(v).lower() if isinstance(v, bool) else v  # as written on the command line
    theirs, ours = saved['model']['execution'], config['model']['execution']
    changed = [f'model.execution.{k}={show(theirs[k])} -> {show(ours[k])}' for k in ours if theirs[k] != ours[k]]
    if changed and jax.process_index() == 0:
      print(f'checkpoint {self.directory}/{step} was written with other execution settings: {", ".join(changed)}',
            flush=True)
    return state

  def restore_latest(self, abstract_state: TrainState, config: dict, data: Any
                     ) -> tuple[int, TrainState] | None:
    """The newest checkpoint that restores on every process, or None. One that does not (truncated or
    missing files) is never half-used: it is renamed <step>.unrestorable, kept, and named in one line on stderr
    (and the one resumed in another)."""
    set_aside = False
    _drop_abandoned_io_reports()  # before a restore can fail: TensorStore's callbacks come as soon as it does
    for step in reversed(self.all_steps()):
      error = None if self.has_optimizer(step) else FileNotFoundError('its optimizer state is missing')
      try:
        state = None if error else self.restore(step, abstract_state, config, data)
      except ConfigError:
        raise
      except Exception as e:  # orbax and tensorstore raise many kinds for damaged files
        error = e
      if all_processes(error is None):
        if set_aside:
          print(f'resuming from {self.directory}/{step}', file=sys.stderr, flush=True)
        return step, state
      set_aside = True
      aside = self.directory / f'{step}{UNRESTORABLE}'
      if jax.process_index() == 0:
        (self.directory / str(step)).rename(aside)
      barrier(f'set_aside_{step}')
      # A failed restore leaves orbax's event loop closed: start a new manager for the next attempt (its
      # abandoned reads released now, not at some later collection).
      self.manager.close()
      gc.collect()
      self.manager = self._manager()
      print(f'checkpoint {self.directory}/{step} does not restore ({_reason(error)}); kept as {aside}; trying the '
            f'one before', file=sys.stderr, flush=True)
    return None

  def restore_params(self, step: int, abstract_params: Any) -> Any:
    """Only the params, placed on `abstract_params`' shardings."""
    read, complete = self._over_base(step, abstract_params)
    return complete(self.manager.restore(step, args=ocp.args.Composite(params=self._restore(read)))['params'])

  def restore_view(self, step: int, abstract_state: TrainState, view: Any) -> Any:
    """The params `view` (an `lm.assembly.optim.ParamsView`) makes of checkpoint `step`, on the params'
    shardings; the optimizer state is read only when the view reads it. `abstract_state` is the assembly's of the
    run's own config."""
    if not view.reads_optimizer:
      return self.restore_params(step, abstract_state.params)
    a = abstract_state
    read, complete = self._over_base(step, a.params)
    restored = self.manager.restore(step, args=ocp.args.Composite(
      params=self._restore(read),
      optimizer=self._restore({'step': a.step, 'opt_state': a.opt_state, 'skipped': a.skipped})))
    return view.of(complete(restored['params']), restored['optimizer']['opt_state'])

  def wait(self) -> None:
    self._write(None, self.manager.wait_until_finished)

  def close(self) -> None:
    self.manager.close()
