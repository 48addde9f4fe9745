"""The jitted train and eval steps: sharded in and out, state donated, microbatches scanned."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from lm.assembly import Assembly
from lm.assembly.state import TrainState, to_device
from lm.config import DistillConfig, largest_batch, microbatches_at
from lm.data.pipeline import feature_specs
from lm.models import logical_axes
from lm.models.family import AHEAD, AUX_LOSS, AUX_TERMS, EXPERT_COUNTS, Head
from lm.models.moe import update_bias
from lm.models.mtp import ahead_keys, look_ahead
from lm.ops.attention.ring import zigzag_order
from lm.ops.losses import distillation, sequence_classification
from lm.ops.unembed import token_loss
from lm.parallel.pipeline import offering_loss, pipelining
from lm.parallel.rules import axis_size, batch_sharding, check_batch, constrain, sharding_context
from lm.train.distill import Distilled, Teacher, abstract_teacher
from lm.train.spikes import guard, nonfinite_steps
from lm.train.watch import watch_metrics

MICRO_SQUARES = 'micro_squares'  # the microbatches' squared gradient norms, added (train.noise_scale)
GNS_SMALL, GNS_BIG = 'gns/small_sq', 'gns/big_sq'  # a microbatch's and the batch's: lm.train.noise_scale reads them

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
AUX_SUM = 'aux:'  # the sums of auxiliary terms, logged under the rest of their name
MTP_NLL, MTP_WEIGHT = 'mtp_nll_', 'mtp_weight_'  # each MTP depth's NLL sum and target weight, by its depth


def abstract_batch(assembly: Assembly) -> Batch:
  """Shapes, dtypes and shardings of a training batch, for ahead-of-time lowering."""
  config = assembly.config
  specs = feature_specs(functools.partial(assembly.family.objective, config))
  return {k: jax.ShapeDtypeStruct((config.train.global_batch, *shape), dtype,
                                  sharding=batch_sharding(assembly.mesh, 1 + len(shape)))
          for k, (shape, dtype) in specs.items()}


def _split_microbatches(batch: Batch, k: int) -> Batch:
  """[B, ...] -> [k, B/k, ...], microbatch i taking rows i, i+k, ... so each spans every data shard."""
  def split(x: jax.Array) -> jax.Array:
    x = x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1)
    return constrain(x, (None, 'batch') + (None,) * (x.ndim - 2))
  return jax.tree.map(split, batch)


def lay_out_sequences(batch: Batch, mesh: jax.sharding.Mesh, seq_len: int) -> Batch:
  """On a mesh that splits the sequence (context parallelism), every per-token feature in the balanced causal
  layout (`zigzag_order`: the order ring attention reads positions from), with explicit positions, so position
  embeddings stay exact; the loss, a sum over tokens, is unchanged by the order. Elsewhere the batch as it is."""
  shards = axis_size(mesh, 'length')
  if shards == 1:
    return batch
  order = zigzag_order(seq_len, shards)
  rows = next(iter(batch.values())).shape[0]
  batch = {'positions': jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (rows, seq_len)), **batch}
  per_token = lambda x: x.ndim >= 2 and x.shape[1] == seq_len
  return {k: constrain(jnp.take(x, order, axis=1), ('batch', 'length') + (None,) * (x.ndim - 2)) if per_token(x)
          else x for k, x in batch.items()}


def pretraining_loss(heads: Sequence[Head], outputs: dict[str, jax.Array], batch: dict[str, jax.Array],
                     z_loss: float, total_weight: jax.Array, total_sequences: jax.Array,
                     ahead_weights: Sequence[jax.Array] = (), mtp_weight: float = 0.0,
                     teacher: jax.Array | None = None, distill: DistillConfig = DistillConfig()
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Token loss per target token, plus each active head's loss per sequence (BERT's NSP), plus `mtp_weight` times
  the mean of the MTP depths' token losses (`model.mtp`), each per its own target tokens (`ahead_weights`). With a
  `teacher`'s logits the token loss is (1 - weight) x itself + weight x the divergence from them per target token
  (`train.distill`).

  Normalised by the WHOLE batch's totals, so microbatch losses and gradients add up exactly; auxiliary losses
  (routed experts) are added weighted, and kept out of the logged token loss.
  Returns (loss, sums of the pieces for metrics: 'nll', 'z', 'distill', '{head}_nll', '{head}_correct', each MTP depth's
  'mtp_nll_{k}', and each auxiliary term as 'aux:{metric name}', times the rows it averages; and the routed
  layers' `EXPERT_COUNTS`, which the step takes out to move their selection biases).
  """
  token_sum, nll, z, _ = token_loss(outputs['logits'], batch['targets'], batch['weights'], z_loss)
  loss = token_sum / total_weight
  sums = {'nll': nll, 'z': z, **routed_sums(outputs, batch)}
  if teacher is not None:
    soft = distillation(outputs['logits'].logits(), teacher, batch['weights'], distill.temperature, distill.divergence,
                        distill.top_k)
    sums['distill'] = jax.lax.stop_gradient(soft)
    loss = (1 - distill.weight) * loss + distill.weight * soft / total_weight
  for k, (head, total) in enumerate(zip(outputs.get(AHEAD, ()), ahead_weights, strict=True), 1):
    _, targets, weights = ahead_keys(k)
    ahead_sum, sums[f'{MTP_NLL}{k}'], _, _ = token_loss(head, batch[targets], batch[weights], z_loss)
    loss = loss + mtp_weight / len(ahead_weights) * ahead_sum / total
  if AUX_LOSS in outputs:
    loss = loss + aux_share(outputs[AUX_LOSS], batch, total_sequences)
  for head in heads:
    sums[f'{head.name}_nll'], sums[f'{head.name}_correct'] = sequence_classification(
      outputs[head.name], batch[head.labels])
    loss = loss + sums[f'{head.name}_nll'] / total_sequences
  return loss, sums


def aux_share(aux_loss: jax.Array, batch: Batch, total_sequences: jax.Array) -> jax.Array:
  """What routed layers' auxiliary loss, a mean over a (micro)batch's rows, adds to the loss: weighted by its share
  of the batch's rows."""
  return aux_loss * jnp.asarray(batch['targets'].shape[0], jnp.float32) / total_sequences


def routed_sums(outputs: dict[str, Any], batch: Batch) -> dict[str, jax.Array]:
  """The routed layers' auxiliary terms times the rows they average, and their token counts, for the metrics."""
  rows = jnp.asarray(batch['targets'].shape[0], jnp.float32)
  sums = {AUX_SUM + name: value * rows for name, value in outputs.get(AUX_TERMS, {}).items()}
  return {**sums, EXPERT_COUNTS: outputs[EXPERT_COUNTS]} if EXPERT_COUNTS in outputs else sums


class StepLoss(Protocol):
  """What a train step minimises: a (micro)batch's loss normalised by whole-batch totals, so microbatch
  losses and gradients add up exactly; `sums` are the pieces the metrics are made of."""

  def prepare(self, batch: Batch) -> Batch:
    """The batch as the loss reads it; the step lays out what it adds with the rest (context parallelism)."""

  # A loss may also read arrays beside the state (a teacher's params): `inputs`, which the step takes as an argument,
  # and `bound(inputs)`, the loss reading them as that argument (traced) inside the step.

  def totals(self, batch: Batch) -> dict[str, jax.Array]: ...

  def __call__(self, params: Any, batch: Batch, rng: jax.Array, totals: dict[str, jax.Array]
               ) -> tuple[jax.Array, dict[str, jax.Array]]: ...

  def metrics(self, sums: dict[str, jax.Array], totals: dict[str, jax.Array]) -> Metrics: ...


@dataclass(frozen=True)
class PretrainingLoss(Distilled):
  """The family's objective: token cross-entropy (plus z-loss) per target token, and each active head's
  loss per sequence (BERT's NSP); with a `teacher` (`train.distill`), the divergence from its logits."""
  assembly: Assembly
  teacher: Teacher | None = None

  def prepare(self, batch):
    """With `model.mtp`, each depth's shifted inputs, targets and weights added."""
    return look_ahead(batch, self.assembly.config.model.mtp.depth)

  def totals(self, batch: Batch) -> dict[str, jax.Array]:
    depths = range(1, self.assembly.config.model.mtp.depth + 1)
    total = lambda weights: jnp.maximum(jnp.sum(weights.astype(jnp.float32)), 1.0)
    return {'weight': total(batch['weights']), 'sequences': jnp.asarray(batch['targets'].shape[0], jnp.float32),
            **{f'{MTP_WEIGHT}{k}': total(batch[ahead_keys(k)[2]]) for k in depths}}

  def of_outputs(self, totals: dict[str, jax.Array], teacher: jax.Array | None = None
                 ) -> Callable[[dict[str, Any], Batch], tuple[jax.Array, Metrics]]:
    """`pretraining_loss` of (the model's outputs, the batch), normalised by the whole batch's `totals`; with the
    `teacher`'s logits of the batch, distilled."""
    a = self.assembly
    mtp = a.config.model.mtp
    return functools.partial(pretraining_loss, a.family.active_heads(a.config.model), z_loss=a.config.train.z_loss,
                             total_weight=totals['weight'], total_sequences=totals['sequences'],
                             ahead_weights=[totals[f'{MTP_WEIGHT}{k}'] for k in range(1, mtp.depth + 1)],
                             mtp_weight=mtp.weight, teacher=teacher, distill=a.config.train.distill)

  def __call__(self, params, batch, rng, totals):
    a = self.assembly
    loss = self.of_outputs(totals, None if self.teacher is None else self.teacher.logits(batch))
    aux = functools.partial(aux_share, total_sequences=totals['sequences'])
    with offering_loss(loss, aux, batch) as offer:  # a stack pipelined by 1F1B takes it in its last stage
      outputs = a.family.apply(a.model, params, batch, deterministic=False, rngs={'dropout': rng})
    if offer.taken is None:
      return loss(outputs, batch)
    value, sums = offer.taken  # routed layers' losses included; their terms and counts are in the outputs
    return value, {**sums, **routed_sums(outputs, batch)}

  def metrics(self, sums, totals):
    metrics = {'loss': sums['nll'] / totals['weight'], 'z_loss': sums['z'] / totals['weight'],
               'target_tokens': totals['weight']}
    if 'distill' in sums:
      metrics['distill_loss'] = sums['distill'] / totals['weight']
    metrics.update({name.removeprefix(AUX_SUM): value / totals['sequences'] for name, value in sums.items()
                    if name.startswith(AUX_SUM)})
    metrics.update({f'mtp/loss_{k}': sums[f'{MTP_NLL}{k}'] / totals[f'{MTP_WEIGHT}{k}']
                    for k in range(1, self.assembly.config.model.mtp.depth + 1)})
    for head in self.assembly.family.active_heads(self.assembly.config.model):
      metrics[f'{head.name}_loss'] = sums[f'{head.name}_nll'] / totals['sequences']
      metrics[f'{head.name}_accuracy'] = sums[f'{head.name}_correct'] / totals['sequences']
    return metrics


def _gradients(grad_fn: Callable, params: Any, batch: Batch, rng: jax.Array, totals: dict[str, jax.Array], k: int,
               squares: bool = False, stages: int = 1, bubble: float = 0.0) -> tuple[Any, dict[str, jax.Array]]:
  """The batch's gradients and loss sums, added over `k` microbatches (a scan) when k > 1; with `squares`, the sums
  also hold the microbatches' squared gradient norms, added (`train.noise_scale`). On a mesh with `stages` the k
  microbatches go through them in one fill and drain instead (their buffers holding `bubble` before the first
  send)."""
  if stages > 1:
    with pipelining(k, bubble):
      return _gradients(grad_fn, params, batch, rng, totals, 1)
  if k == 1:
    (_, sums), grads = grad_fn(params, batch, rng, totals)
    return grads, sums

  def accumulate(carry: tuple, inputs: tuple) -> tuple[tuple, None]:
    micro, i = inputs
    (_, sums), grads = grad_fn(params, micro, jax.random.fold_in(rng, i), totals)
    if squares:
      sums = {**sums, MICRO_SQUARES: optax.tree.norm(grads, squared=True)}
    return jax.tree.map(jnp.add, carry, (grads, sums)), None
  micro = _split_microbatches(batch, k)
  shapes = jax.eval_shape(grad_fn, params, jax.tree.map(lambda x: x[0], micro), rng, totals)
  sums_shape = {**shapes[0][1], **({MICRO_SQUARES: jax.ShapeDtypeStruct((), jnp.float32)} if squares else {})}
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), (shapes[1], sums_shape))
  (grads, sums), _ = jax.lax.scan(accumulate, zeros, (micro, jnp.arange(k)))
  return grads, sums


def make_train_step(assembly: Assembly, loss: StepLoss) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
  """jit(step): gradients of `loss` (`PretrainingLoss`; a task's) over `train.microbatches` (accumulated, or on a
  mesh with stages pipelined), one optimizer update, the non-finite guard of `train.on_nonfinite`; routed layers'
  selection biases (`model.moe.bias_rate`) move after the update, from the step's token counts."""
  config, tx, mesh, seed = assembly.config, assembly.tx, assembly.mesh, assembly.config.train.seed
  stop_at_nonfinite = config.train.on_nonfinite == 'stop'
  for t in (config.train, largest_batch(config).train):  # the first batch and a batch ramp's last
    check_batch(mesh, t.global_batch, t.microbatches)
  schedule = assembly.schedule
  inputs = getattr(loss, 'inputs', None)
  watch_every = config.train.watch_every
  axes = logical_axes(assembly.model) if watch_every else None
  bias_rate = config.model.moe.bias_rate
  noise_scale = config.train.noise_scale
  resting = assembly.abstract_state

  def step(state: TrainState, batch: Batch, inputs: Any = None) -> tuple[TrainState, Metrics]:
    step_loss = loss if inputs is None else loss.bound(inputs)
    grad_fn = _differentiated(_held(step_loss, assembly.fixed))
    # offloaded params and optimizer state come in for the step; the out-shardings put them back
    state = state.replace(params=to_device(state.params, resting.params),
                          opt_state=to_device(state.opt_state, resting.opt_state))
    k = microbatches_at(config, jax.tree.leaves(batch)[0].shape[0])  # a batch ramp's stages differ
    with sharding_context(mesh):
      batch = lay_out_sequences(step_loss.prepare(batch), mesh, config.data.seq_len)
      rng = jax.random.fold_in(jax.random.key(seed), state.step)
      totals = step_loss.totals(batch)
      grads, sums = _gradients(grad_fn, state.params, batch, rng, totals, k, noise_scale, mesh.shape['stage'])
      counts = sums.pop(EXPERT_COUNTS, None)  # summed over microbatches, and (global arrays) over data shards
      micro_squares = sums.pop(MICRO_SQUARES, None)
      logged = step_loss.metrics(sums, totals)
      with jax.named_scope('optimizer'):  # profiles (bench/profile_step.py) group its kernels by this name
        grad_norm = optax.tree.norm(grads)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if counts is not None:
          params = update_bias(params, counts, bias_rate)
        finite = functools.reduce(jnp.logical_and, [jnp.isfinite(v) for v in sums.values()], jnp.isfinite(grad_norm))
        skip_spike, window, spike_metrics = guard(state.spike_window, logged['loss'], grad_norm, finite, config.train)
        # A non-finite step keeps the old state; under `stop` so does every later one, until the loop ends the run.
        withheld = ~finite | skip_spike
        apply = ~withheld & (nonfinite_steps(state) == 0) if stop_at_nonfinite else ~withheld
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(apply, new, old), (params, opt_state),
                                         (state.params, state.opt_state))
      skipped = state.skipped + withheld.astype(jnp.int32)
    # the rate this step's update used: the optimizer's count (and schedule) stops at skipped steps
    metrics = {**logged, 'grad_norm': grad_norm, 'learning_rate': schedule(state.step - state.skipped),
               'nonfinite': (~finite).astype(jnp.float32), 'skipped_steps': skipped, **spike_metrics}
    if config.train.batch_ramp:
      metrics['batch'] = jnp.asarray(jax.tree.leaves(batch)[0].shape[0], jnp.int32)
    if micro_squares is not None:  # a microbatch's mean gradient is k times its share of the batch's
      metrics.update({GNS_SMALL: k * micro_squares, GNS_BIG: grad_norm ** 2})
    if watch_every:  # off, the step's program is as without it
      metrics.update(_watched(state.step + 1, watch_every, {'params': params, 'grads': grads, 'updates': updates},
                              axes))
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state, skipped=skipped,
                      spike_window=window), metrics

  return _jitted(step, assembly.shardings, inputs)


def _jitted(step: Callable, shardings: TrainState, inputs: Any) -> Callable:
  """jit(step), its state donated; with a loss's `inputs`, a step called (and lowered) as (state, batch) that hands
  them in. The batch and the inputs arrive as global arrays already sharded (see batch_sharding)."""
  if inputs is None:
    return jax.jit(step, in_shardings=(shardings, None), out_shardings=(shardings, None), donate_argnums=(0,))
  return _WithInputs(jax.jit(step, in_shardings=(shardings, None, None), out_shardings=(shardings, None),
                             donate_argnums=(0,)), inputs)


@dataclass(frozen=True)
class _WithInputs:
  """A train step taking its loss's `inputs` (a teacher's params) as an argument: called, and lowered, as
  (state, batch)."""
  step: Any
  inputs: Any

  def __call__(self, state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
    return self.step(state, batch, self.inputs)

  def lower(self, state: Any, batch: Any) -> jax.stages.Lowered:
    return self.step.lower(state, batch, self.inputs)


def _held(loss: StepLoss, fixed: Any) -> Callable:
  """`loss` with no gradient flowing into the params nothing trains (`fixed`: model.lora's frozen base, selection
  biases): their weight gradients are never computed, and the logged grad_norm is the trained params'."""
  if fixed is None or not any(jax.tree.leaves(fixed)):
    return loss
  return lambda params, *rest: loss(jax.tree.map(lambda p, f: jax.lax.stop_gradient(p) if f else p, params, fixed),
                                    *rest)


def _differentiated(loss: Callable) -> Callable:
  """value_and_grad of `loss` (with aux) in its params; an int8 base's params (int8 values, frozen) get gradients
  of zeros in their own dtype, which the optimizer leaves as they are."""
  grad_fn = jax.value_and_grad(loss, has_aux=True, allow_int=True)

  def differentiated(params: Any, *rest: Any) -> tuple[Any, Any]:
    out, grads = grad_fn(params, *rest)
    return out, jax.tree.map(lambda g, p: jnp.zeros_like(p) if g.dtype == jax.dtypes.float0 else g, grads, params)
  return differentiated


def _watched(step: jax.Array, every: int, trees: dict[str, Any], axes: Any) -> Metrics:
  """watch_metrics at every `every`-th step, zeros at the others (the loop logs only the former)."""
  with jax.named_scope('watch'):
    compute = lambda: watch_metrics(trees, axes)
    zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(compute))
    return jax.lax.cond(step % every == 0, compute, zeros)


def lower_train_step(assembly: Assembly) -> jax.stages.Lowered:
  """The pretraining train step lowered for the assembly's abstract state and batch, with its teacher's
  (`train.distill`) abstract params (nothing allocated)."""
  loss = PretrainingLoss(assembly, abstract_teacher(assembly))
  return make_train_step(assembly, loss).lower(assembly.abstract_state, abstract_batch(assembly))


def compile_train_step(assembly: Assembly) -> jax.stages.Compiled:
  """The train step compiled ahead of time for the assembly's mesh (memory and cost analysis)."""
  return lower_train_step(assembly).compile()


def make_eval_step(assembly: Assembly) -> Callable[[Any, Batch], Metrics]:
  """Sums of weighted NLL, weights and (batches with `target_bytes`) the weighted targets' UTF-8 bytes for one
  batch; the caller adds them over batches."""
  family, model, mesh = assembly.family, assembly.model, assembly.mesh

  def step(params: Any, batch: Batch) -> Metrics:
    with sharding_context(mesh):
      batch = lay_out_sequences(batch, mesh, assembly.config.data.seq_len)
      head = family.apply(model, params, batch, deterministic=True, rngs={})['logits']
      _, nll, _, weight = token_loss(head, batch['targets'], batch['weights'])
    sums = {'nll': nll, 'weight': weight}
    if 'target_bytes' in batch:
      sums['bytes'] = jnp.sum(batch['target_bytes'].astype(jnp.float32) * batch['weights'])
    return sums
  return jax.jit(step, in_shardings=(assembly.params_shardings, None))


def make_score_step(assembly: Assembly, score: Callable[[Any, Any, Batch], Any] | None = None
                    ) -> Callable[[Any, Batch], Any]:
  """jit: per-example outputs of a batch split over the mesh's batch axes, returned whole to every process.
  `score(model, params, batch)` defaults to the family's continuation scores (`Family.score` of a `Scoring.rows`
  batch); a fine-tuning head's prediction (`TaskHead.infer`) goes through the same step."""
  model, mesh = assembly.model, assembly.mesh
  score = assembly.family.score if score is None else score

  def step(params: Any, batch: Batch) -> Any:
    with sharding_context(mesh):
      return score(model, params, batch)
  return jax.jit(step, in_shardings=(assembly.params_shardings, None),
                 out_shardings=NamedSharding(mesh, PartitionSpec()))
