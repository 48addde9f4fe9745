"""`lm finetune --task dpo`: direct preference optimisation (Rafailov et al. 2023) through the one loop.

The policy trains from `--init`; the reference is the init, frozen. Its log-probabilities enter each batch as
data, so the train state holds the policy alone (no reference gradients, no reference optimizer state):
`--reference precomputed` (default) scores every pair once at the start and keeps them in
`RUN/reference_logps.npz`; `--reference frozen` keeps the init's params on the devices, sharded like the policy's
(under `model.lora` with adapters that start fresh, the policy's own base with its adapters off, scored inside
each step: no second copy),
and scores each batch as it comes. Both give the same numbers (to float32 rounding: the rows are scored in
other batches). Log-probabilities come from the family's scoring
seam (`Family.score` on `Scoring.rows`: a pair's prompt and completion in one row, the completion weighted), the
chosen and rejected rows of a pair in one forward, without dropout.

Losses, as TRL's DPOTrainer computes them (delta: the chosen log-ratio to the reference minus the rejected one):
`sigmoid` -log sigmoid(beta delta); `ipo` (each log-ratio averaged over its completion's tokens) (delta -
1/(2 beta))^2; `robust` (label_smoothing e, the chance a label is flipped) the unbiased mix of both directions'
sigmoid losses over 1 - 2e. Metrics under TRL's names: rewards/chosen and /rejected (beta times each log-ratio),
rewards/accuracies, rewards/margins, logps/chosen and /rejected, averaged over pairs.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lm.assembly import Assembly, assemble
from lm.config import Config, ConfigError, from_dict
from lm.data.pipeline import HostRows, global_rows
from lm.data.preference import Pair, encode_pair, read_pairs
from lm.jobs.chat.sft import ChatOptions, RunFiles, chat_template, sft_config
from lm.jobs.finetuning import load_tokenizer, source_config
from lm.models.family import scoring_of
from lm.parallel.rules import sharding_context
from lm.train.callbacks import Callback, Evaluate
from lm.train.init_from import initial_state
from lm.train.loop import Trainer
from lm.train.step import make_score_step

LossType = Literal['sigmoid', 'ipo', 'robust']
REFERENCE_FILE = 'reference_logps.npz'  # in the run dir: the reference's log-probabilities of every pair
SETTINGS_FILE = 'dpo.json'  # in the run dir: the settings the run trains with, checked on --resume
ROWS = ('inputs', 'targets', 'segment_ids', 'weights', 'positions')


@dataclass(frozen=True)
class DPOSettings:
  beta: float = 0.1
  loss_type: LossType = 'sigmoid'
  label_smoothing: float = 0.0
  reference: Literal['precomputed', 'frozen'] = 'precomputed'

  def check(self) -> None:
    if not self.beta > 0:
      raise ConfigError(f'--beta {self.beta} must be > 0')
    if self.loss_type not in ('sigmoid', 'ipo', 'robust'):
      raise ConfigError(f'--loss-type {self.loss_type} is not supported; choose one of: sigmoid, ipo, robust')
    if self.loss_type == 'robust' and not 0 <= self.label_smoothing < 0.5:
      raise ConfigError(f'--label-smoothing {self.label_smoothing} must be in [0, 0.5) for the robust loss')
    if self.loss_type != 'robust' and self.label_smoothing:
      raise ConfigError(f'--label-smoothing applies to --loss-type robust (the chance a label is flipped); '
                        f'{self.loss_type} takes none')


def pair_rows(assembly: Assembly, pairs: list[Pair], pad_id: int) -> dict[str, np.ndarray]:
  """Each pair's chosen and rejected rows (`Scoring.rows`), [pairs, 2, seq_len] per feature."""
  rows = scoring_of(assembly.family).rows(
    [(p.prompt, c) for p in pairs for c in (p.chosen, p.rejected)], assembly.config.data.seq_len, pad_id)
  return {k: v.reshape(len(pairs), 2, *v.shape[1:]) for k, v in rows.items()}


def _flat(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
  return {k: batch[k].reshape(-1, *batch[k].shape[2:]) for k in ROWS}


@dataclass(frozen=True)
class DPOLoss:
  """The DPO loss of a batch of pairs (with their reference log-probabilities, 'ref_logps' [pairs, 2]), per pair
  of the whole batch, so microbatches add up."""
  assembly: Assembly
  settings: DPOSettings

  def prepare(self, batch):
    return batch

  def totals(self, batch):
    valid = batch.get('valid')  # evaluation: 0 for the repeats that fill its last batch
    return {'pairs': jnp.asarray(batch['inputs'].shape[0], jnp.float32) if valid is None else jnp.sum(valid)}

  def __call__(self, params, batch, rng, totals):
    a, s = self.assembly, self.settings
    scores = a.family.score(a.model, params, _flat(batch))
    logps, tokens = scores['logprob'].reshape(-1, 2), scores['tokens'].reshape(-1, 2).astype(jnp.float32)
    reference = batch['ref_logps'] if 'ref_logps' in batch else self.base_logps(params, batch)
    ratios = logps - reference.astype(jnp.float32)
    delta = ratios[:, 0] - ratios[:, 1]
    if s.loss_type == 'sigmoid':
      per_pair = -jax.nn.log_sigmoid(s.beta * delta)
    elif s.loss_type == 'ipo':
      average = ratios / jnp.maximum(tokens, 1.0)
      per_pair = (average[:, 0] - average[:, 1] - 1 / (2 * s.beta)) ** 2
    else:
      e = s.label_smoothing
      per_pair = (-(1 - e) * jax.nn.log_sigmoid(s.beta * delta) + e * jax.nn.log_sigmoid(-s.beta * delta)) / (1 - 2 * e)
    rewards, kept = jax.lax.stop_gradient(s.beta * ratios), jax.lax.stop_gradient(logps)
    valid = batch.get('valid', jnp.ones_like(delta))
    total = lambda x: jnp.sum(x * valid)
    sums = {'loss': total(per_pair), 'rewards/chosen': total(rewards[:, 0]), 'rewards/rejected': total(rewards[:, 1]),
            'rewards/accuracies': total((rewards[:, 0] > rewards[:, 1]).astype(jnp.float32)),
            'rewards/margins': total(rewards[:, 0] - rewards[:, 1]), 'logps/chosen': total(kept[:, 0]),
            'logps/rejected': total(kept[:, 1])}
    return sums['loss'] / totals['pairs'], sums

  def metrics(self, sums, totals):
    return {k: v / totals['pairs'] for k, v in sums.items()}

  def base_logps(self, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """[pairs, 2] log-probabilities of the frozen base under `model.lora` (the policy's params, its adapters off),
    the reference with no second copy of the weights (TRL's adapter-disabled reference)."""
    if not self.assembly.config.model.lora.rank:
      raise ValueError('a batch without ref_logps is scored against the frozen base, which needs model.lora')
    off = jax.tree_util.tree_map_with_path(
      lambda path, p: jnp.zeros_like(p) if path[-1].key == 'lora_b' else jax.lax.stop_gradient(p), params)
    return self.assembly.family.score(self.assembly.model, off, _flat(batch))['logprob'].reshape(-1, 2)


class Reference:
  """The init's log-probabilities of pairs: its params on the devices (sharded like the policy's), scored with
  the family's scoring step."""

  def __init__(self, assembly: Assembly, params: Any):
    self.assembly, self.params, self.score = assembly, params, make_score_step(assembly)

  def logps(self, batch: dict[str, jax.Array]) -> jax.Array:
    return self.score(self.params, _flat(batch))['logprob'].reshape(-1, 2)

  def of_rows(self, rows: dict[str, np.ndarray]) -> np.ndarray:
    """[pairs, 2] for host rows, a global batch at a time (the last wraps)."""
    n, batch, out = len(rows['inputs']), self.assembly.config.train.global_batch, []
    for start in range(0, n, batch):
      index = np.arange(start, start + batch) % n
      out.append(np.asarray(self.logps(global_rows(self.assembly.mesh, {k: rows[k][index] for k in ROWS}))))
    return np.concatenate(out)[:n]


class WithReference:
  """A stream of pair batches with the frozen reference's log-probabilities added; its position is the rows'."""

  def __init__(self, rows: HostRows, reference: Reference):
    self.rows, self.reference = rows, reference

  def __iter__(self) -> WithReference:
    return self

  def __next__(self) -> dict[str, jax.Array]:
    batch = next(self.rows)
    return {**batch, 'ref_logps': self.reference.logps(batch)}


class PairEval:
  """DPO's metrics on held-out pairs (their reference log-probabilities scored once), as eval/<metric>."""

  def __init__(self, loss: DPOLoss, rows: dict[str, np.ndarray], reference: Reference | None):
    """`reference` None: the frozen base scores each batch in the step (`DPOLoss.base_logps`)."""
    self.loss, self.rows = loss, rows if reference is None else {**rows, 'ref_logps': reference.of_rows(rows)}
    def sums(params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
      with sharding_context(loss.assembly.mesh):  # the layers' sharding constraints, as in the train step
        return loss(params, batch, None, loss.totals(batch))[1]
    self.step = jax.jit(sums, in_shardings=(loss.assembly.params_shardings, None))

  def __call__(self, params: Any, step: int) -> dict[str, float]:
    a = self.loss.assembly
    n, size, sums = len(self.rows['inputs']), a.config.train.global_batch, {}
    for start in range(0, n, size):
      index = np.arange(start, start + size)
      batch = {**{k: v[index % n] for k, v in self.rows.items()}, 'valid': (index < n).astype(np.float32)}
      out = jax.device_get(self.step(params, global_rows(a.mesh, batch)))
      sums = {k: sums.get(k, 0.0) + float(v) for k, v in out.items()}
    record = {f'eval/{k}': v / n for k, v in sums.items()}
    print(f'dpo step {step}: ' + ', '.join(f'{k} {v:.4f}' for k, v in record.items()), flush=True)
    return record


def dpo_config(options: ChatOptions, num_pairs: int) -> Config:
  """SFT's recipe and defaults (`sft_config`) at DPO's learning rate (5e-7 unless given), in runs/dpo/."""
  config = sft_config(options, num_pairs)
  values = config.to_dict()
  source = config.name.removesuffix('-sft')
  values['name'] = f'{source}-dpo'
  if config.train.run_dir == f'runs/sft/{source}':
    values['train']['run_dir'] = f'runs/dpo/{source}'
  if not any(o.startswith('optim.learning_rate=') for o in options.overrides):
    values['optim']['learning_rate'] = 5e-7
  if values['mesh'].get('sequence', 1) != 1:
    raise ConfigError('DPO does not split sequences over the mesh (mesh.sequence); use mesh.data or mesh.fsdp')
  return from_dict(values)


def _reference_logps(run_dir: Any, reference: Reference, rows: dict[str, np.ndarray], init: str) -> np.ndarray:
  """The reference's log-probabilities of every training pair: read from the run dir when they were scored for
  these rows and this init (a resumed run), else scored and kept."""
  path, mark = run_dir / REFERENCE_FILE, hashlib.sha256(init.encode())
  for key in ROWS:
    mark.update(np.ascontiguousarray(rows[key]).tobytes())
  if path.exists():
    with np.load(path) as saved:
      if str(saved['rows']) == mark.hexdigest():
        return saved['logps']
  logps = reference.of_rows(rows)
  if jax.process_index() == 0:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(path, 'wb') as f:
      np.savez(f, logps=logps, rows=np.array(mark.hexdigest()))
  return logps


def finetune_dpo(options: ChatOptions, settings: DPOSettings, devices: Sequence[jax.Device] | None = None
                 ) -> dict[str, Any] | None:
  """Trains `options.init` on the preference pairs (on `devices`, default all); returns the last held-out
  evaluation (None when a SIGTERM stopped the run, its state checkpointed for `--resume`)."""
  settings.check()
  records, skipped = read_pairs(options.data)
  held_out, held_skipped = read_pairs(options.eval_data) if options.eval_data else ([], [])
  for name, gone, kept in (('--data', skipped, records), ('--eval-data', held_skipped, held_out)):
    if gone:
      print(f'dpo: skipped {len(gone)} of the {len(gone) + len(kept)} pairs of {name} whose chosen and rejected are '
            f'identical ({", ".join(gone[:3])}{", ..." if len(gone) > 3 else ""}): they prefer nothing', flush=True)
  probe = source_config(options.init)
  tokenizer = load_tokenizer(probe)
  conversational = any(not isinstance(r['prompt'], str) for r, _ in records + held_out)
  template = chat_template(options, probe) if conversational else None
  encode = lambda items: [encode_pair(tokenizer, template, r, where) for r, where in items]
  pairs, held = encode(records), encode(held_out)
  config = dpo_config(options, len(pairs))
  if config.train.distill.teacher is not None:
    raise ConfigError(f'train.distill.teacher={config.train.distill.teacher}: DPO learns from preferences, not a '
                      f'teacher\'s tokens; drop it (distil with lm finetune --task sft or lm train)')
  print(f'dpo: {len(pairs)} pairs, {config.train.steps} steps of {config.train.global_batch}; outputs in '
        f'{config.run_dir}', flush=True)
  assembly = assemble(config, devices)
  loss = DPOLoss(assembly, settings)
  trainer = Trainer(assembly, loss, run_dir=config.run_dir)
  start = initial_state(assembly, options.init)
  # adapters that start fresh leave the init its base: a frozen reference is then the policy's own base, its
  # adapters off, scored in each step with no second copy of the weights
  in_step = settings.reference == 'frozen' and any(name.endswith('/lora_b') for name in start.fresh)
  reference = None if in_step else Reference(assembly, assembly.params_of(start.state))
  del start
  rows = pair_rows(assembly, pairs, tokenizer.pad_id)
  callbacks: list[Callback] = [RunFiles(config.run_dir, {SETTINGS_FILE: json.dumps(asdict(settings)) + '\n'})]
  if held:
    callbacks.append(Evaluate(PairEval(loss, pair_rows(assembly, held, tokenizer.pad_id), reference),
                              config.train.eval_every, at_start=True, params_of=assembly.params_of))
  if settings.reference == 'precomputed':
    stream = position = HostRows({**rows, 'ref_logps': _reference_logps(config.run_dir, reference, rows, options.init)},
                                 config.train.global_batch, config.train.seed, assembly.mesh)
    reference.params = None  # every log-probability it gives is taken: its params leave the devices
  else:
    position = HostRows(rows, config.train.global_batch, config.train.seed, assembly.mesh)
    stream = position if reference is None else WithReference(position, reference)
  records_out = trainer.run(stream, lambda: initial_state(assembly, options.init).state, callbacks,
                            position=position)
  if trainer.stopped_at is not None:
    return None
  evaluations = [r for r in records_out if any(k.startswith('eval/') for k in r)]
  return evaluations[-1] if evaluations else {}
