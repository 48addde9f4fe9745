"""`lm finetune --task dpo`: the loss and TRL's reward metrics equal TRL's DPOTrainer's; a tiny Llama learns to
prefer; the reference is data, not state."""
import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import torch
import transformers

from lm import cli
from lm.assembly import assemble
from lm.data.chat import load_template
from lm.data.pipeline import global_rows
from lm.data.preference import encode_pair, read_pairs
from lm.data.tokenizers import HFTokenizer
from lm.jobs.chat import dpo
from lm.jobs.chat.dpo import DPOLoss, DPOSettings, Reference, dpo_config, finetune_dpo, pair_rows
from lm.jobs.chat.sft import ChatOptions
from lm.train.init_from import initial_state
from tests.jobs.chat.conftest import WORDS

METRICS = ('rewards/chosen', 'rewards/rejected', 'rewards/accuracies', 'rewards/margins', 'logps/chosen',
           'logps/rejected')


def preference_pairs(path, count, seed, conversational=True):
  """'echo W': W is chosen, another word rejected."""
  rng = np.random.default_rng(seed)
  with open(path, 'w') as f:
    for _ in range(count):
      word, other = rng.choice(WORDS, 2, replace=False)
      if conversational:
        record = {'prompt': [{'role': 'user', 'content': f'echo {word}'}],
                  'chosen': [{'role': 'assistant', 'content': str(word)}],
                  'rejected': [{'role': 'assistant', 'content': str(other)}]}
      else:
        record = {'prompt': f'echo {word}:', 'chosen': f' {word}', 'rejected': f' {other}'}
      f.write(json.dumps(record) + '\n')


@pytest.fixture(scope='module')
def other_llama(tiny_llama, tmp_path_factory):
  """The same architecture with other, larger random weights: a reference far from the policy (log-ratios of
  several nats, so the rewards, differences of two sums of log-probabilities, keep float32's relative precision)."""
  directory = tmp_path_factory.mktemp('other_llama')
  config = transformers.AutoConfig.from_pretrained(tiny_llama)
  config.initializer_range = 0.2
  transformers.set_seed(1)
  transformers.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)
  transformers.AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(directory)
  return directory


def trl_metrics(policy, reference, data, loss_type, beta, tmp_path):
  """TRL's DPOTrainer's loss and logged metrics on one batch of every pair."""
  import datasets
  import trl
  records = [json.loads(line) for line in open(data)]
  model, ref = (transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in (policy, reference))
  args = trl.DPOConfig(output_dir=str(tmp_path / 'trl'), beta=beta, loss_type=[loss_type], report_to=[],
                       per_device_train_batch_size=len(records), max_length=None, use_cpu=True,
                       bf16=False)  # its default autocasts the reference's forward to bfloat16
  trainer = trl.DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=datasets.Dataset.from_list(records),
                           processing_class=transformers.AutoTokenizer.from_pretrained(policy))
  batch = next(iter(trainer.get_train_dataloader()))
  trainer.model.train()  # the metrics of a training step (a Llama has no dropout)
  with torch.no_grad():
    loss = float(trainer.compute_loss(trainer.model, batch))
  return {'loss': loss, **{k: trainer._metrics['train'][k][-1] for k in METRICS}}


@pytest.mark.parametrize('loss_type, conversational', [('sigmoid', True), ('ipo', True), ('sigmoid', False)])
@pytest.mark.variants
def test_loss_and_rewards_equal_trl(tiny_llama, other_llama, tmp_path, loss_type, conversational):
  """Policy and reference two different random Llamas: our loss and every reward metric equal TRL's (1e-4)."""
  data = tmp_path / 'pairs.jsonl'
  preference_pairs(data, 8, 0, conversational)
  settings = DPOSettings(beta=0.3, loss_type=loss_type)
  options = ChatOptions(data=str(data), init=str(tiny_llama),
                        overrides=('data.seq_len=32', 'train.global_batch=8', 'model.execution.dtype=float32'))
  assembly = assemble(dpo_config(options, 8))
  tokenizer = HFTokenizer(tiny_llama)
  template = load_template(tiny_llama) if conversational else None
  pairs = [encode_pair(tokenizer, template, r, w) for r, w in read_pairs(str(data))[0]]
  rows = pair_rows(assembly, pairs, tokenizer.pad_id)
  rows['ref_logps'] = Reference(assembly, initial_state(assembly, str(other_llama)).state.params).of_rows(rows)
  loss = DPOLoss(assembly, settings)
  batch = global_rows(assembly.mesh, rows)
  totals = loss.totals(batch)
  value, sums = jax.jit(lambda p, b: loss(p, b, None, totals))(initial_state(assembly, str(tiny_llama)).state.params,
                                                                batch)
  ours = {'loss': float(value), **{k: float(v) for k, v in loss.metrics(sums, totals).items() if k in METRICS}}
  theirs = trl_metrics(tiny_llama, other_llama, data, loss_type, 0.3, tmp_path)
  assert 0 < theirs['rewards/accuracies'] < 1 and abs(theirs['rewards/margins']) > 1e-3  # not a trivial batch
  for key, value in theirs.items():
    assert ours[key] == pytest.approx(value, rel=1e-4), (key, ours, theirs)


@pytest.mark.long(1)
def test_dpo_learns_to_prefer_and_the_reference_is_data(tiny_llama, echo_sft, tmp_path, capsys):
  """From the SFT run (its template read from the run dir), held-out rewards/accuracies rises from 0 (the policy is
  its reference) above 0.9. Scoring the reference per batch from its frozen params (`frozen`) trains as scoring it
  once (`precomputed`), on 40 pairs of which 2 have identical chosen and rejected (skipped, and said once); either
  way the checkpointed state is the policy's alone (the items and trees of any training state)."""
  preference_pairs(tmp_path / 'train.jsonl', 256, 0)
  preference_pairs(tmp_path / 'eval.jsonl', 32, 1)
  common = ('data.seq_len=32', 'train.global_batch=16', 'optim.learning_rate=1e-3')
  assert cli.main(['finetune', '--task', 'dpo', '--init', str(echo_sft / 'run'), '--data',
                   str(tmp_path / 'train.jsonl'), '--eval-data', str(tmp_path / 'eval.jsonl'), '--beta', '0.5',
                   *common, 'train.steps=100', 'train.eval_every=100', f'train.run_dir={tmp_path}/learned']) == 0
  records = [json.loads(line) for line in (tmp_path / 'learned' / 'metrics.jsonl').read_text().splitlines()]
  start, end = (next(r for r in records if r['step'] == s and 'eval/loss' in r) for s in (0, 100))
  assert start['eval/rewards/accuracies'] == 0 and end['eval/rewards/accuracies'] > 0.9, (start, end)
  assert end['eval/rewards/margins'] > 0 and end['eval/loss'] < start['eval/loss']

  lines = (tmp_path / 'train.jsonl').read_text().splitlines()[:38]
  same = lambda word: json.dumps({'prompt': f'echo {word}:', 'chosen': f' {word}', 'rejected': f' {word}'})
  (tmp_path / 'some_same.jsonl').write_text('\n'.join([*lines[:10], same('a'), *lines[10:], same('b')]) + '\n')

  def run(name, reference, steps):
    overrides = (*common, f'train.steps={steps}', f'train.eval_every={steps}', f'train.run_dir={tmp_path}/{name}')
    options = ChatOptions(data=str(tmp_path / 'some_same.jsonl'), eval_data=str(tmp_path / 'eval.jsonl'),
                          init=str(tiny_llama), overrides=overrides)
    return finetune_dpo(options, DPOSettings(beta=0.5, reference=reference))
  capsys.readouterr()
  run('frozen', 'frozen', 4)
  out = capsys.readouterr().out
  assert out.count('dpo: skipped') == 1 and 'skipped 2 of the 40 pairs of --data' in out, out
  assert f'some_same.jsonl:11, {tmp_path}/some_same.jsonl:40' in out and 'dpo: 38 pairs' in out, out
  run('precomputed', 'precomputed', 4)
  losses = lambda name: [(r['step'], r['loss'], r['rewards/margins']) for r in map(
    json.loads, (tmp_path / name / 'metrics.jsonl').read_text().splitlines()) if 'rewards/margins' in r]
  assert len(losses('frozen')) == 4  # the reference scored in other batches: equal to float32 rounding
  np.testing.assert_allclose(losses('frozen'), losses('precomputed'), rtol=1e-6, atol=1e-6)
  assert (tmp_path / 'precomputed' / 'reference_logps.npz').is_file()
  assert not (tmp_path / 'frozen' / 'reference_logps.npz').exists()
  config = dpo_config(ChatOptions(data='', init=str(tiny_llama), overrides=common), 1)
  a = assemble(config).abstract_state
  assert sorted(p.name for p in (tmp_path / 'frozen' / 'checkpoints' / '4').iterdir() if p.is_dir()) == \
    ['config', 'data', 'optimizer', 'params']
  with ocp.CheckpointManager(tmp_path / 'frozen' / 'checkpoints') as manager:  # orbax matches trees exactly
    manager.restore(4, args=ocp.args.Composite(
      params=ocp.args.StandardRestore(a.params),
      optimizer=ocp.args.StandardRestore({'step': a.step, 'opt_state': a.opt_state, 'skipped': a.skipped})))


def test_bad_preference_records_are_one_line(tiny_llama, tmp_path, capsys):
  same = '{"prompt": "a", "chosen": "b", "rejected": "b"}'
  cases = [(same, '1 of the 1 pairs in'), (f'{same}\n{same}', 'identical chosen and rejected, so the set prefers'),
           ('{"prompt": "a", "chosen": "b"}', 'needs prompt, chosen and rejected (it has chosen, prompt)'),
           ('{"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"}',
            'must be all strings or all message lists'),
           ('{"prompt": [{"role": "robot", "content": "a"}], "chosen": [{"role": "assistant", "content": "b"}], '
            '"rejected": [{"role": "assistant", "content": "c"}]}', "unknown role 'robot'")]
  for line, needle in cases:
    (tmp_path / 'bad.jsonl').write_text(line + '\n')
    argv = ['finetune', '--task', 'dpo', '--init', str(tiny_llama), '--data', str(tmp_path / 'bad.jsonl')]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert 'bad.jsonl:1: ' in err and needle in err, err
  (tmp_path / 'ok.jsonl').write_text('{"prompt": "a", "chosen": "b", "rejected": "c"}\n')
  for flags, needle in [(['--beta', '0'], '--beta 0.0 must be > 0'),
                        (['--loss-type', 'hinge'], 'choose one of: sigmoid, ipo, robust'),
                        (['--label-smoothing', '0.1'], '--label-smoothing applies to --loss-type robust')]:
    assert cli.main(['finetune', '--task', 'dpo', '--init', str(tiny_llama), '--data', str(tmp_path / 'ok.jsonl'),
                     *flags]) == 2
    assert needle in capsys.readouterr().err


def test_lora_scores_the_frozen_base_inside_the_step_as_the_reference_scored_once(tiny_llama, tmp_path, monkeypatch):
  """With fresh adapters (`model.lora`), `--reference frozen` scores the reference inside each step as the policy's
  own params with the adapters off, keeping no second copy; it trains as the init scored once (`precomputed`), the
  margins moving off 0 as the adapters learn while the reference stays."""
  preference_pairs(tmp_path / 'train.jsonl', 32, 0)
  preference_pairs(tmp_path / 'eval.jsonl', 16, 1)

  def run(reference):
    overrides = ('data.seq_len=32', 'train.global_batch=16', 'optim.learning_rate=1e-2', 'train.steps=3',
                 'train.eval_every=3', 'model.lora.rank=4', f'train.run_dir={tmp_path}/{reference}')
    options = ChatOptions(data=str(tmp_path / 'train.jsonl'), eval_data=str(tmp_path / 'eval.jsonl'),
                          init=str(tiny_llama), overrides=overrides)
    evaluation = finetune_dpo(options, DPOSettings(beta=0.5, reference=reference))
    steps = [(r['step'], r['loss'], r['rewards/margins']) for r in map(
      json.loads, (tmp_path / reference / 'metrics.jsonl').read_text().splitlines()) if 'rewards/margins' in r]
    return np.array(steps), evaluation
  with monkeypatch.context() as patch:  # no reference params on the devices
    patch.setattr(dpo, 'Reference', lambda *args: pytest.fail('a second copy of the weights was made'))
    frozen, frozen_eval = run('frozen')
  precomputed, precomputed_eval = run('precomputed')
  np.testing.assert_allclose(frozen, precomputed, rtol=1e-5, atol=1e-6)
  assert abs(frozen[-1, 2]) > 1e-3 and frozen_eval['eval/rewards/margins'] != 0
  np.testing.assert_allclose(frozen_eval['eval/loss'], precomputed_eval['eval/loss'], rtol=1e-5)
  assert not (tmp_path / 'frozen' / 'reference_logps.npz').exists()
