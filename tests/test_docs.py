"""Every fenced command of the README and the docs/ pages, run in order as a new user would, in a fresh working
directory; and the pages' own checks: every command fence is tagged, every relative link and anchor resolves, every
page is reachable from the README's map.

The pages are read in the docs' order: the README, then the pages of its map in the map's order, then any other
page they link to. The directory holds what the commands name and a user would bring (a YAML config, text and JSONL
files, an HF GPT-2 and BERT saved by transformers, GLUE files, evaluation task files), with `launch/` and `bench/`
copied from this checkout. Commands run as written, with `lm` and `python` from this venv (an `lm` command as bash
would hand it its words, in a fork of a process that imported lm once: tests/lm_forks.py); the only changes are
SHORTER's (fewer steps and smaller sweeps, so every page runs in minutes) and `--dry-run` on the cloud launchers.
What cannot run offline is in OFFLINE_ONLY with the reason; what another test runs and checks (a minute of
compiling each, not repeated here) is in ELSEWHERE with that test's name; each entry must still match a documented
command, so no list outlives the docs.
"""
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
import yaml

from lm.config import load_config
from tests.conftest import built_once
from tests.jobs.evals import releases
from tests.jobs.glue.test_data import write_glue_files
from tests.jobs.glue.test_finetune import save_hf_bert
from tests.lm_forks import Forks
from tests.storage.convert.test_series import hub_cache, save_revisions

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r'^(\s*)```(\S*)\s*$')
LINK = re.compile(r'!?\[(?:[^\]`]|`[^`]*`)*\]\(([^)\s]+)\)')
COMMAND = re.compile(r'^\s*(?:\$ )?(?:lm |python bench/|python launch/)')  # a line a reader would run


def fences(markdown: str) -> list[tuple[str, list[str]]]:
  """Each fenced block of a page: its tag (`bash`, `text`, ``) and its lines (fences inside lists are indented)."""
  blocks, tag, lines = [], None, []
  for line in markdown.splitlines():
    fence = FENCE.match(line)
    if fence and tag is None:
      tag, lines = fence[2], []
    elif fence and not fence[2]:
      blocks.append((tag, lines))
      tag = None
    elif tag is not None:
      lines.append(line)
  return blocks


def links_in(markdown: str) -> list[str]:
  """The targets of Markdown links and images, outside fences and inline code."""
  text, inside = [], False
  for line in markdown.splitlines():
    if FENCE.match(line):
      inside = not inside
    elif not inside:
      text.append(re.sub(r'(?<!\[)`[^`]*`(?!\])', '', line))
  return LINK.findall('\n'.join(text))


def links(page: Path) -> list[str]:
  return links_in(page.read_text())


def local_target(page: Path, target: str) -> tuple[Path, str] | None:
  """The file and anchor a relative link names, or None for a URL."""
  if re.match(r'^[a-z]+:', target):
    return None
  path, _, anchor = target.partition('#')
  return (page.parent / path).resolve() if path else page, anchor


def doc_pages() -> list[Path]:
  """The README, the pages of its map (its `## Documentation` section) in the map's order, then every other page
  under docs/ reached by following links, breadth first."""
  readme = ROOT / 'README.md'
  order, queue = [readme], [readme]
  while queue:
    page = queue.pop(0)
    targets = links(page)
    if page == readme:
      in_map = links_in(readme.read_text().split('\n## Documentation\n')[1].split('\n## ')[0])
      targets = in_map + [t for t in targets if t not in in_map]
    for target in targets:
      found = local_target(page, target)
      if (found and found[0].suffix == '.md' and found[0].is_file() and found[0] not in order
          and (ROOT / 'docs') in found[0].parents):
        order.append(found[0])
        queue.append(found[0])
  return order


def docs_text() -> str:
  return '\n'.join(page.read_text() for page in doc_pages())
TRAINING = ['train.steps=2', 'train.eval_every=2', 'train.eval_batches=1', 'train.checkpoint.every=2',
            'train.log_every=1', 'optim.warmup_steps=1', 'train.global_batch=4']  # batch 4: a 2-step run ~20% less CPU
# (a regex on the command, what replaces each match): shorter runs, same commands.
SHORTER = [
  (r'^\.venv/bin/', lambda m: ''),  # the set-up's first command, from the venv that is on PATH here
  (r'^lm (train|finetune) .*$', lambda m: m[0] + ' ' + ' '.join(TRAINING)),
  (r'^lm scaling sweep (.*)$', lambda m: 'lm scaling sweep ' + re.sub(r' --budgets \S+', '', m[1])
   + (' --sizes 64x1,128x1 --budgets 2e9,4e9' if '--budgets' in m[1]
      else ' --sizes 64x1,128x1,192x1 --tokens 4096,8192')),
  (r'^(lm tokenizer train .*) --vocab-size \d+(.*)$', lambda m: f'{m[1]} --vocab-size 1000 --max-lines 5000{m[2]}'),
  (r'^(lm train .*data\.tokenizer=sentencepiece:.*) model\.vocab_size=16000(.*)$',
   lambda m: f'{m[1]} model.vocab_size=1000{m[2]}'),
  (r'^(python launch/(tpu|slurm)\.py .*?)( -- .*)?$', lambda m: f'{m[1]} --dry-run{m[3] or ""}'),
  (r'^python bench/train_throughput\.py .*$', lambda m: m[0] + ' --steps 2'),
  (r'^(lm scaling sweep .*) --lr-grid \S+(.*)$',
   lambda m: f'{m[1]} --lr-grid 1e-3,3e-3{m[2]} --sizes 64x1 --tokens 4096'),
  (r' --bootstrap 1000 ', lambda m: ' --bootstrap 100 '),
  (r' train\.seed=0,1,2', lambda m: ' train.seed=0'),  # a 3-point GLUE sweep
  (r'^python bench/attention_memory\.py.*$', lambda m: m[0] + ' --lengths 512'),  # the cooldown branches at the shortened stable run's end (step 2) and decays over its own last 2 steps
  (r'^lm train .*train\.run_dir=runs/stable( .*)?$', lambda m: m[0] + ' train.steps=4'),  # losses after 2 updates
  (r'train\.batch_ramp=\[[^\]]*\]', lambda m: 'train.batch_ramp=[8@1]'),  # within the 2 steps, twice batch 4
  (r'^(lm train .*train\.branch_from=runs/stable/checkpoints/)800(.*)$',
   lambda m: f'{m[1]}2{m[2]} train.steps=4 optim.decay_fraction=0.5'),
]
OFFLINE_ONLY = {  # a command's start -> why this machine cannot run it
  'python3 -m venv': 'the set-up: CI runs it (.ci/run)',
  '.venv/bin/pip install': 'the set-up: CI runs it (.ci/run)',
  '.venv/bin/python -m pytest': 'the test suite: this test is part of it',
  'lm train --config gpt3_125m data.source=tfds data.name=c4/en:3.1.0 data.data_dir=gs://':
    'C4 in a cloud bucket; the same path runs on a local TFDS dataset below',
  'lm finetune --task sst2 --source tfds': 'TFDS glue/sst2 must be downloaded to be prepared',
  'python -m maxtext.trainers.pre_train.train_compile': 'MaxText 0.2.5 needs Python 3.12 and an environment of its own',
  'python bench/maxtext_breakdown.py': 'MaxText 0.2.5 needs Python 3.12 and an environment of its own',
  'python bench/pipeline_side_by_side.py': 'MaxText 0.2.5 needs Python 3.12 and an environment of its own',
}

ROWS_TEST = ('tests/bench/test_rows_per_device.py::'
             'test_each_row_count_reports_the_compiled_memory_of_that_batch_under_each_lever')
ELSEWHERE = {  # a command's start -> the test that runs it (the same command on the same kind of files) and checks
  'python bench/peers.py': 'tests/bench/test_peers.py::test_one_round_reports_each_contender_and_the_ratio',
  'python launch/local.py --processes 2 --devices-per-process 4 -- lm train --config gpt_tiny mesh.data=2 mesh.fsdp=4':
    'tests/launch/test_local.py::test_two_processes_train_like_one_process_with_all_devices',
  'lm compile --config gpt3_175b': 'tests/planning/test_compile.py::test_each_preset_fits_its_slice_as_written',
  'lm compile --config llama2_7b': 'tests/planning/test_compile.py::test_each_preset_fits_its_slice_as_written',
  'lm scaling coord-check --config gpt_tiny --widths 64,128,256,512':  # to 512 there, 1024 here
    'tests/jobs/scaling/test_coord_check.py::test_mup_is_flat_in_width_and_standard_is_not',
  'python bench/compile_table.py':
    'tests/bench/test_compile_table.py::test_a_row_is_the_preset_compiled_for_its_slice_and_it_fits',
  'lm finetune --task glue --data-dir glue_data --init path/to/bert-base-uncased':
    'tests/jobs/glue/test_finetune.py::test_glue_from_an_hf_bert_writes_every_leaderboard_file',
  'lm finetune --task sft --init path/to/chat_model':  # the chat model and files the user brings: tests/jobs/chat
    'tests/jobs/chat/test_sft.py::test_sft_learns_to_echo_a_word',
  'lm finetune --task dpo --init runs/sft/chat_model':
    'tests/jobs/chat/test_dpo.py::test_dpo_learns_to_prefer_and_the_reference_is_data',
  'python bench/rows_per_device.py --levers': ROWS_TEST,  # llama2_7b and llama3_8b: each compile a minute or two
  'python bench/rows_per_device.py --config llama3_8b': ROWS_TEST,
  'python bench/rows_per_device.py --rows ': ROWS_TEST,  # docs/results/tpu_step.md's reproductions
  'lm compile --config mixtral_8x7b --memory-breakdown':
    'tests/planning/test_compile.py::test_mixtral_8x7b_fits_its_slice_on_the_dropless_and_the_capacity_path',
  'lm compile --config llama2_7b train.global_batch=':
    'tests/planning/test_compile.py::test_host_memory_is_reported_and_a_step_beyond_the_hosts_exits_3',
  'lm train --config gpt_tiny optim.schedule=constant train.steps=2000 \'train.checkpoint.at=[200,2000]\'':
    'tests/jobs/scaling/test_cbs.py::test_the_same_command_gives_the_same_table_and_a_late_cbs_is_at_least_an_early_one',
  'lm scaling cbs runs/cbs_base':
    'tests/jobs/scaling/test_cbs.py::test_the_same_command_gives_the_same_table_and_a_late_cbs_is_at_least_an_early_one',
  'lm finetune --task mrpc --data-dir glue_data --init runs/bert_tiny --sweep':
    'tests/jobs/glue/test_finetune.py::test_a_sweep_of_lora_fine_tunes_reports_mean_std_and_best',
}


def logical_lines(markdown: str) -> list[str]:
  """The commands of the ```bash blocks as written (bash expands `~` and globs as it would for a user):
  continuation lines joined, comments and blank lines dropped, `a; b` and `a && b` split."""
  lines = [line.strip() for tag, block in fences(markdown) if tag == 'bash' for line in block]
  joined = re.sub(r'\\\n\s*', ' ', '\n'.join(lines))
  uncommented = (re.sub(r'(^|\s)#.*$', '', line).strip() for line in joined.splitlines())
  return [part.strip() for line in uncommented for part in re.split(r';|&&', line) if part.strip()]


def as_run(command: str) -> str:
  """The command with its [optional parts] taken, and SHORTER applied."""
  command = re.sub(r'\[(--[^\]=]*)\]', r'\1', command)  # `[--json] [--num-slices 2]`; not `data.paths=[...]`
  for pattern, replace in SHORTER:
    command = re.sub(pattern, replace, command)
  return command


def user_files(cwd: Path, home: Path) -> None:
  """What the documented commands expect a user to have in their working directory and home."""
  for folder in ('launch', 'bench'):
    shutil.copytree(ROOT / folder, cwd / folder, ignore=shutil.ignore_patterns('results', '__pycache__'))
  (cwd / 'docs').mkdir()
  tiny = load_config('gpt_tiny')
  (cwd / 'path/to').mkdir(parents=True)
  (cwd / 'path/to/my.yaml').write_text(yaml.safe_dump({**tiny.to_dict(), 'train': {**tiny.to_dict()['train'],
                                                                                   'run_dir': 'runs/my'}}))
  # An HF GPT-2 of gpt_tiny's shape (so `--config gpt_tiny train.init_from=` takes it), random weights.
  torch.manual_seed(0)
  transformers.GPT2LMHeadModel(transformers.GPT2Config(
    vocab_size=tiny.model.vocab_size, n_embd=tiny.model.d_model, n_layer=tiny.model.num_layers,
    n_head=tiny.model.num_heads, n_positions=tiny.model.max_len, activation_function='gelu_new', bos_token_id=0,
    eos_token_id=0,
  )).save_pretrained(cwd / 'path/to/hf_model', safe_serialization=True)
  save_hf_bert(cwd / 'path/to/bert-base-uncased')
  # A corpus: the largest modules of Python's standard library, as text files and as JSONL paragraphs.
  stdlib = sorted(Path(sysconfig.get_paths()['stdlib']).glob('*.py'), key=lambda f: -f.stat().st_size)[:12]
  for i, module in enumerate(stdlib):
    text = module.read_text(encoding='utf-8')
    (cwd / f'corpus/part{i % 3}').mkdir(parents=True, exist_ok=True)
    (cwd / f'corpus/part{i % 3}/{module.stem}.txt').write_text(text)
    (cwd / f'corpus/{module.stem}.jsonl').write_text(''.join(json.dumps({'text': para}) + '\n'
                                                             for para in text.split('\n\n') if para.strip()))
  # FineWeb's layout: Parquet files with `text` beside `id` and `url`, in row groups
  (cwd / 'fineweb/sample/10BT').mkdir(parents=True)
  paragraphs = [p for module in stdlib for p in module.read_text(encoding='utf-8').split('\n\n') if p.strip()]
  for i in range(2):
    part = paragraphs[i::2]
    pq.write_table(pa.table({'text': part, 'id': [f'<urn:uuid:{i}-{j}>' for j in range(len(part))],
                             'url': ['https://docs.python.org/'] * len(part)}),
                   cwd / f'fineweb/sample/10BT/00{i}_00000.parquet', row_group_size=1000)
  # Dolma's layout: gzip-compressed JSON lines with `id`, `text`, `source` and `metadata`
  (cwd / 'dolma/v1_7').mkdir(parents=True)
  for i in range(2):
    lines = [json.dumps({'id': f'{i}-{j}', 'text': p, 'source': 'stdlib', 'metadata': {}})
             for j, p in enumerate(paragraphs[i::2])]
    (cwd / f'dolma/v1_7/stdlib-000{i}.json.gz').write_bytes(gzip.compress('\n'.join(lines).encode() + b'\n'))
  datasets.DatasetDict({'train': datasets.Dataset.from_dict({'text': paragraphs[:-100]}),
                        'validation': datasets.Dataset.from_dict({'text': paragraphs[-100:]})}
                       ).save_to_disk(cwd / 'datasets/my_dataset')
  (cwd / 'eval').mkdir()  # held-out code
  for name in ('json/decoder.py', 'csv.py'):
    shutil.copy(Path(sysconfig.get_paths()['stdlib']) / name, cwd / 'eval' / name.replace('/', '_'))
  write_glue_files(cwd / 'glue_data')
  # Two checkpoint series of byte-level models: a GPT-NeoX's revisions in the hub cache, an OLMo 2's in folders
  revisions = save_revisions(home / 'suite', ['step1000', 'step2000'], vocab=264)
  hub_cache(revisions, home / '.cache/huggingface/hub', 'models--EleutherAI--pythia-160m')
  shutil.rmtree(home / 'suite')
  olmo2 = transformers.Olmo2Config(vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=256)
  for step, tokens in ((1000, 4), (2000, 8)):
    torch.manual_seed(step)
    transformers.Olmo2ForCausalLM(olmo2).save_pretrained(cwd / f'olmo2_1b_revisions/stage1-step{step}-tokens{tokens}B',
                                                         safe_serialization=True)
  releases.write_both(cwd / 'eval_data', cwd / 'eval_data_hub_layout')  # the seven tasks' release files


def slugs(page: Path) -> set[str]:
  """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens, a repeat
  numbered."""
  seen, out, inside = {}, set(), False
  for line in page.read_text().splitlines():
    if FENCE.match(line):
      inside = not inside
      continue
    heading = re.match(r'^#{1,6} (.+)$', line)
    if heading and not inside:
      slug = re.sub(r'[^\w\- ]', '', heading[1].replace('`', '').lower()).replace(' ', '-')
      out.add(slug if slug not in seen else f'{slug}-{seen[slug]}')
      seen[slug] = seen.get(slug, 0) + 1
  return out


def fence_problems(page: Path) -> list[str]:
  """A fence holding a command a reader would run must be `bash` (run here) or `text` (a synopsis with
  placeholders)."""
  problems = []
  for tag, lines in fences(page.read_text()):
    command = next((line for line in lines if COMMAND.match(line)), None)
    if command is not None and tag not in ('bash', 'text'):
      problems.append(f'{page.name}: the fence holding `{command.strip()}` is tagged {tag!r}: tag it bash or text')
  return problems


def link_problems(page: Path) -> list[str]:
  """Every relative link names a file, and an anchor into a page names one of its headings."""
  problems = []
  for target in links(page):
    found = local_target(page, target)
    if found is None:
      continue
    path, anchor = found
    if not path.exists():
      problems.append(f'{page.name}: the link {target} names no file')
    elif anchor and path.suffix == '.md' and anchor not in slugs(path):
      problems.append(f'{page.name}: the link {target} names no heading of {path.name}')
  return problems


def test_every_command_fence_is_tagged():
  assert not [p for page in doc_pages() for p in fence_problems(page)]


def test_every_link_and_anchor_resolves():
  assert not [p for page in doc_pages() for p in link_problems(page)]


def test_the_checks_catch_an_untagged_fence_and_broken_links(tmp_path):
  """The checks above on a page made to fail them: an untagged command fence (indented in a list too), a link to
  a missing file, an anchor no heading makes; and what passes: tagged fences, an output block, a heading's anchor
  with code and punctuation in it, a URL."""
  (tmp_path / 'other.md').write_text('# Other\n\n## The `lm train` loop: step by step\n')
  page = tmp_path / 'page.md'
  page.write_text('# Page\n\n```\nlm train --config gpt_tiny\n```\n\n1. A step:\n\n   ```\n   python bench/peers.py\n'
                  '   ```\n\n```bash\nlm eval --model RUN\n```\n\n```text\nlm eval --model RUN_DIR\n```\n\n```\nsteps 60\n```\n\n'
                  '[gone](missing.md) [anchor](other.md#no-such-part) [fine](other.md#the-lm-train-loop-step-by-step) '
                  '[here](#page) [web](https://example.com/x.md) `[not a link](nowhere.md)`\n')
  assert fence_problems(page) == [
    "page.md: the fence holding `lm train --config gpt_tiny` is tagged '': tag it bash or text",
    "page.md: the fence holding `python bench/peers.py` is tagged '': tag it bash or text"]
  assert link_problems(page) == ['page.md: the link missing.md names no file',
                                 'page.md: the link other.md#no-such-part names no heading of other.md']


def test_every_page_is_reachable_from_the_readme():
  pages = {p.resolve() for p in (ROOT / 'docs').rglob('*.md')} - {ROOT / 'docs/index.md'}  # the site's README
  unreachable = sorted(str(p.relative_to(ROOT)) for p in pages - set(doc_pages()))
  assert not unreachable, f'no link from the README reaches {unreachable}: add each to a page that is reached'


def generator():
  """docs/generate.py as a module (a script beside the pages, not part of the package)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location('docs_generate', ROOT / 'docs/generate.py')
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_generated_references_are_current():
  done = subprocess.run([sys.executable, 'docs/generate.py', '--check'], cwd=ROOT, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr


def test_a_config_field_added_without_regenerating_is_caught(monkeypatch, capsys):
  """The reference is made from the dataclasses themselves: a new field of train differs from the committed page,
  and the check names the page and the command that rewrites it."""
  import dataclasses
  from lm import config
  extended = dataclasses.make_dataclass('TrainConfig', [('new_knob', int, dataclasses.field(default=7))],
                                        bases=(config.TrainConfig,), frozen=True)
  monkeypatch.setattr(config, 'TrainConfig', extended)
  generate = generator()
  assert '| `train.new_knob` | int | `7` |' in generate.config_reference()
  assert generate.main(['--check']) == 1
  assert 'docs/reference/config.md differs from what the code gives: run `python docs/generate.py`' in \
    capsys.readouterr().err


def test_the_site_builds(tmp_path):
  """mkdocs (the docs extra) builds the pages with the generated navigation, in the README map's order."""
  pytest.importorskip('mkdocs')
  nav = yaml.safe_load((ROOT / 'mkdocs.yml').read_text())['nav']
  pages = [next(iter(item.values())) for item in nav]
  mapped = [str(p.relative_to(ROOT / 'docs')) for p in doc_pages()[1:]]
  assert pages[0] == 'index.md' and pages[1:] == [p for p in mapped if p in pages[1:]], (pages, mapped)
  done = subprocess.run([str(Path(sys.executable).parent / 'mkdocs'), 'build', '-q', '-f', str(ROOT / 'mkdocs.yml'),
                         '-d', str(tmp_path / 'site')], capture_output=True, text=True, timeout=300,
                        env={**os.environ, 'NO_MKDOCS_2_WARNING': '1'})
  assert done.returncode == 0, done.stderr[-3000:]
  assert (tmp_path / 'site/getting-started/index.html').is_file()


def test_commands_name_every_exception():
  """Each SHORTER, OFFLINE_ONLY and ELSEWHERE entry still matches a documented command; ELSEWHERE's tests exist."""
  commands = logical_lines(docs_text())
  for pattern, _ in SHORTER:
    assert any(re.search(pattern, c) for c in commands), f'SHORTER {pattern!r} matches no documented command'
  for start in OFFLINE_ONLY:
    assert any(c.startswith(start) for c in commands), f'OFFLINE_ONLY {start!r} matches no documented command'
  for start, test in ELSEWHERE.items():
    assert any(c.startswith(start) for c in commands), f'ELSEWHERE {start!r} matches no documented command'
    path, name = test.split('::')
    assert f'def {name}(' in (ROOT / path).read_text(), f'ELSEWHERE names {test}, which does not exist'


# Commands run in groups, each in its own working directory, so the groups run side by side (xdist). A group holds
# the commands (regexes on the command as run) that need an earlier one's output, in the docs' order (a command that
# two groups need runs in both); a command no group names runs in the first CATCH_ALL group whose regex matches.
GROUPS = {
  'gpt_tiny': (r'lm train --config gpt_tiny (--resume )?train\.steps=2 ',
               r'lm (generate|convert|eval|report) .*runs/gpt_tiny', r'lm train .*distill\.teacher=runs/gpt_tiny'),
  'imported': (r'lm convert --from-hf ', r'lm .*runs/imported'),
  'bert': (r'lm train --config bert_tiny ', r'lm finetune .*runs/bert_tiny'),
  't5': (r'lm train --config t5_tiny ', r'lm finetune .*runs/t5_tiny'),
  'tfds': (r'lm data build ', r'lm train .*my_corpus'),
  # `collect --evaluate` reads the built dataset; `collect --eval code` the run with held-out sets
  'scaling': (r'lm scaling (?!.*\bsuite\b)(?!.*--law curve)(?!.*--curves)(?!predict )', r'lm data build ',
              r'lm train .*runs/sets '),
  'curves': (r'lm train .*runs/(stable|cooldown_1000)', r'lm scaling (fit .*--law curve|predict |plot .*--curves)'),
  'tokenizer': (r'lm tokenizer train --config gpt_tiny ', r'lm train .*sentencepiece:'),
  'suite': (r'lm convert --from-hf-series ', r'lm scaling (collect|plot) .*suite'),
  'shards': (r'lm data tokenize .*--tokenizer byte ', r'lm train .*tokenized:shards/'),
  'pod': (r'lm tokenizer train --config llama2_7b ', r'lm data tokenize .*tokenizers/pod',
          r'python launch/local\.py .*shards/pod'),
}
CATCH_ALL = {'trains': r'lm train ', 'others': r''}


def group_commands() -> dict[str, list[str]]:
  """Each group's commands as run, in the docs' order (a command once per group; skipped ones left out)."""
  groups = {name: [] for name in (*GROUPS, *CATCH_ALL)}
  for command in logical_lines(docs_text()):
    if any(command.startswith(start) for start in (*OFFLINE_ONLY, *ELSEWHERE)):
      continue
    run = as_run(command)
    named = [name for name, patterns in GROUPS.items() if any(re.match(p, run) for p in patterns)]
    for name in named or [next(name for name, pattern in CATCH_ALL.items() if re.match(pattern, run))]:
      if run not in groups[name]:
        groups[name].append(run)
  return groups


def test_every_group_runs_commands():
  """No group outlives the docs."""
  assert all(group_commands().values()), {name: runs for name, runs in group_commands().items() if not runs}


@pytest.fixture(scope='session')
def user_template() -> Path:
  """user_files made once per run (HF models, tokenizer, corpus: ~6 s; work/ and home/) and copied for each
  group."""
  def build(template):
    (template / 'work').mkdir()
    (template / 'home').mkdir()
    user_files(template / 'work', template / 'home')
  return built_once('docs_user', build)


@pytest.mark.long(3)
@pytest.mark.parametrize('group', [*GROUPS, *CATCH_ALL])
def test_every_documented_command_runs(tmp_path, group, user_template):
  cwd, home = tmp_path / 'work', tmp_path / 'home'
  shutil.copytree(user_template / 'work', cwd, symlinks=True)
  shutil.copytree(user_template / 'home', home, symlinks=True)
  venv = str(Path(sys.executable).parent)
  # XLA as the suite runs it (optimisation level 0 compiles ~3x faster; these runs are a few steps), with the
  # suite's compilation cache (conftest.py): most of the commands compile the same few programs.
  env = {**os.environ, 'HOME': str(home), 'PATH': venv + os.pathsep + os.environ['PATH'], 'COLUMNS': '100',
         'XLA_FLAGS': '--xla_backend_optimization_level=0'}
  with Forks(env) as lm:  # `lm` commands: forks of one process that imported lm (tests/lm_forks.py)
    for run in group_commands()[group]:
      if re.fullmatch(r'lm [^|<>`$]*', run):  # bash's words, as it would hand them to `lm`
        words = subprocess.run(['bash', '-c', 'printf "%s\\0" ' + run], cwd=cwd, env=env, capture_output=True,
                               text=True, check=True).stdout.split('\0')[:-1]
        done = lm.run(words[1:], cwd)
      else:
        done = subprocess.run(['bash', '-c', run], check=False, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=900)
      assert done.returncode == 0, f'{run}\nexit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}'
      # A command that does its job prints nothing on stderr: no warnings or tracebacks for a user to read past.
      assert done.stderr == '', f'{run}\nprinted on stderr:\n{done.stderr[-3000:]}'
  assert lm.startup_stderr == '', f'importing lm printed on stderr:\n{lm.startup_stderr[-3000:]}'
