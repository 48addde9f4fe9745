"""Fixture data for the seven tasks, written twice from the same random rows: in each task's original release
layout (EVAL-NOTES) and in the Hugging Face dataset's layout the harness reads. Contexts end in spaces, carry
unicode, and some run past the model's length."""
import json

import numpy as np

WORDS = ['the', 'cut', 'bread', 'knife', 'pour', 'water', 'café', 'glass', 'fold', 'paper', 'crease', 'naïve', 'which', 'planet', 'closest', 'sun', 'mercury', 'venus', 'earth', 'mars', '—', 'µm', 'energy', 'cells', 'divide']


def jsonl(path, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(''.join(json.dumps(r, ensure_ascii=False) + '\n' for r in rows), encoding='utf-8')


def text(rng, n):
  return ' '.join(rng.choice(WORDS, n))


def long_or_short(rng, i, long_every=4):
  return text(rng, 70 if i % long_every == 0 else 7) + (' ' if i % 3 == 0 else '')


def hellaswag(rng, n):
  return [{'ind': i, 'activity_label': text(rng, 2), 'ctx_a': long_or_short(rng, i), 'ctx_b': text(rng, 3),
           'ctx': text(rng, 5), 'endings': [text(rng, k) for k in (2, 3, 4, 5)], 'source_id': f's{i}',
           'split': 'val', 'split_type': 'indomain', 'label': int(rng.integers(4))} for i in range(n)]


def piqa(rng, n):
  return [{'goal': long_or_short(rng, i), 'sol1': text(rng, 4), 'sol2': text(rng, 7)} for i in range(n)], \
      [int(rng.integers(2)) for _ in range(n)]


def arc(rng, n):
  rows = []
  for i in range(n):
    labels = ['A', 'B', 'C', 'D'] if i % 2 else ['1', '2', '3', '4']
    rows.append({'id': f'q{i}', 'question': {'stem': long_or_short(rng, i) + '?',
                                             'choices': [{'text': text(rng, k), 'label': label}
                                                         for k, label in zip((1, 2, 3, 4), labels)]},
                 'answerKey': labels[int(rng.integers(4))]})
  return rows


def winogrande(rng, n):
  return [{'sentence': f'{long_or_short(rng, i).strip()} _ {text(rng, 4)}.', 'option1': text(rng, 1),
           'option2': text(rng, 2), 'answer': str(int(rng.integers(1, 3)))} for i in range(n)]


def boolq(rng, n):
  return [{'question': text(rng, 5), 'title': text(rng, 2), 'answer': bool(rng.integers(2)),
           'passage': long_or_short(rng, i)} for i in range(n)]


def sciq(rng, n):
  return [{'question': text(rng, 6), 'distractor1': text(rng, 1), 'distractor2': text(rng, 2),
           'distractor3': text(rng, 1), 'correct_answer': text(rng, 2), 'support': ' ' + long_or_short(rng, i)}
          for i in range(n)]


def write_both(original, hf, seed=0, n=8):
  """Writes the seven tasks' fixtures under `original` (release layouts) and `hf` (dataset layouts)."""
  rng = np.random.default_rng(seed)
  for split, file in (('train', 'hellaswag_train.jsonl'), ('validation', 'hellaswag_val.jsonl')):
    rows = hellaswag(rng, n)
    jsonl(original / 'hellaswag' / file, rows)
    jsonl(hf / 'hellaswag' / f'{split}.jsonl', [{**r, 'label': str(r['label'])} for r in rows])  # HF: strings
  for split, name in (('train', 'train'), ('validation', 'valid')):
    rows, labels = piqa(rng, n)
    jsonl(original / 'piqa' / f'{name}.jsonl', rows)
    (original / 'piqa' / f'{name}-labels.lst').write_text(''.join(f'{label}\n' for label in labels))
    jsonl(hf / 'piqa' / f'{split}.jsonl', [{**r, 'label': label} for r, label in zip(rows, labels)])
  for level in ('Easy', 'Challenge'):
    for split, name in (('train', 'Train'), ('validation', 'Dev'), ('test', 'Test')):
      rows = arc(rng, n)
      jsonl(original / 'arc' / 'ARC-V1-Feb2018-2' / f'ARC-{level}' / f'ARC-{level}-{name}.jsonl', rows)
      jsonl(hf / f'arc_{level.lower()}' / f'{split}.jsonl',
            [{'id': r['id'], 'question': r['question']['stem'],
              'choices': {'text': [c['text'] for c in r['question']['choices']],
                          'label': [c['label'] for c in r['question']['choices']]},
              'answerKey': r['answerKey']} for r in rows])
  rows = [{'text': long_or_short(rng, i).strip() + ' ' + text(rng, 1)} for i in range(n)]
  jsonl(original / 'lambada_openai' / 'lambada_test.jsonl', rows)
  jsonl(hf / 'lambada_openai' / 'test.jsonl', rows)
  for split, name in (('train', 'train_xl'), ('validation', 'dev')):
    rows = winogrande(rng, n)
    jsonl(original / 'winogrande' / 'winogrande_1.1' / f'{name}.jsonl', rows)
    jsonl(hf / 'winogrande' / f'{split}.jsonl', rows)
  for split, name in (('train', 'train'), ('validation', 'dev')):
    rows = boolq(rng, n)
    jsonl(original / 'boolq' / f'{name}.jsonl', rows)
    jsonl(hf / 'boolq' / f'{split}.jsonl', [{'question': r['question'], 'passage': r['passage'], 'idx': i,
                                             'label': int(r['answer'])} for i, r in enumerate(rows)])
  for split, name in (('train', 'train'), ('validation', 'valid'), ('test', 'test')):
    rows = sciq(rng, n)
    (original / 'sciq').mkdir(parents=True, exist_ok=True)
    (original / 'sciq' / f'{name}.json').write_text(json.dumps(rows, ensure_ascii=False), encoding='utf-8')
    jsonl(hf / 'sciq' / f'{split}.jsonl', rows)


TASKS = ('hellaswag', 'piqa', 'arc_easy', 'arc_challenge', 'lambada_openai', 'winogrande', 'boolq', 'sciq')
