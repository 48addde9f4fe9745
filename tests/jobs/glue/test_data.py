"""GLUE split reading: hand-written files in each task's real column layout (GLUE's download script), and TFDS."""
import dataclasses

import pytest
import tensorflow_datasets as tfds

from lm.config import ConfigError
from lm.jobs.glue.data import read_split, read_tfds, read_tsv, split_path
from lm.jobs.glue.tasks import AX, TASKS

MNLI_TRAIN_HEAD = ('index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse'
                   '\tsentence2_parse\tsentence1\tsentence2')
MNLI_DEV_HEAD = MNLI_TRAIN_HEAD + '\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label'
STSB_HEAD = 'index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2'


def cls(task: str, label: str) -> int:
  return TASKS[task].labels.index(label)


# Each file as GLUE's download script writes it (path under DIR -> lines), with the examples it must give as
# (index, texts, label). Indices of files without an id column are row numbers.
FILES = {
  'CoLA/train.tsv': (['gj04\t1\t\tOur friends won\'t buy this analysis.', 'gj04\t0\t*\tThey drank the pub.'],
                     [('0', ("Our friends won't buy this analysis.",), 1), ('1', ('They drank the pub.',), 0)]),
  'CoLA/dev.tsv': (['gj04\t0\t*\tThe more we study, the more it gets.'],
                   [('0', ('The more we study, the more it gets.',), 0)]),
  'CoLA/test.tsv': (['index\tsentence', '7\tBill whistled past the house.'],
                    [('7', ('Bill whistled past the house.',), None)]),
  'SST-2/train.tsv': (['sentence\tlabel', 'hide new secretions \t0', 'He said "hi\t1', '"quoted start\t0'],
                      [('0', ('hide new secretions ',), 0), ('1', ('He said "hi',), 1), ('2', ('"quoted start',), 0)]),
  'SST-2/dev.tsv': (['sentence\tlabel', "it 's a charming journey . \t1"],
                    [('0', ("it 's a charming journey . ",), 1)]),
  'SST-2/test.tsv': (['index\tsentence', '3\tuneasy mishmash .'], [('3', ('uneasy mishmash .',), None)]),
  'MRPC/train.tsv': (['Quality\t#1 ID\t#2 ID\t#1 String\t#2 String',
                      '1\t702876\t702977\tHe called " the witness " a liar .\tHe called him " the witness " .',
                      '0\t2108705\t2108831\tYucaipa owned Dominick \'s .\tYucaipa bought Dominick \'s .'],
                     [('0', ('He called " the witness " a liar .', 'He called him " the witness " .'), 1),
                      ('1', ("Yucaipa owned Dominick 's .", "Yucaipa bought Dominick 's ."), 0)]),
  'MRPC/dev.tsv': (['Quality\t#1 ID\t#2 ID\t#1 String\t#2 String', '0\t1\t2\tA .\tB .'], [('0', ('A .', 'B .'), 0)]),
  'MRPC/test.tsv': (['index\t#1 ID\t#2 ID\t#1 String\t#2 String', '12\t1089874\t1089925\tPCCW rose .\tPCCW fell .'],
                    [('12', ('PCCW rose .', 'PCCW fell .'), None)]),
  'STS-B/train.tsv': ([STSB_HEAD + '\tscore',
                       '0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane takes off.'
                       '\tA jet takes off.\t5.000',
                       '1\tmain-news\theadlines\t2013\t0002\tnone\tnone\tA cat.\tA dog.\t0.4'],
                      [('0', ('A plane takes off.', 'A jet takes off.'), 5.0), ('1', ('A cat.', 'A dog.'), 0.4)]),
  'STS-B/dev.tsv': ([STSB_HEAD + '\tscore', '4\tmain-forums\tdeft\t2014\t0003\tnone\tnone\tX.\tY.\t3.800'],
                    [('4', ('X.', 'Y.'), 3.8)]),
  'STS-B/test.tsv': ([STSB_HEAD, '9\tmain-news\theadlines\t2015\t0004\tnone\tnone\tP.\tQ.'],
                     [('9', ('P.', 'Q.'), None)]),
  'QQP/train.tsv': (['id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate',
                     '133273\t213221\t213222\tHow is "life" as a math student?\tWhich level is enough?\t0',
                     '402555\t536040\t536041\tHow do I stay calm?\tHow do you stay calm?\t1'],
                    [('133273', ('How is "life" as a math student?', 'Which level is enough?'), 0),
                     ('402555', ('How do I stay calm?', 'How do you stay calm?'), 1)]),
  'QQP/dev.tsv': (['id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate', '5\t10\t11\tWhy?\tWhy not?\t1'],
                  [('5', ('Why?', 'Why not?'), 1)]),
  'QQP/test.tsv': (['id\tquestion1\tquestion2', '0\tWhy am I lonely?\tHow to stop being lonely?'],
                   [('0', ('Why am I lonely?', 'How to stop being lonely?'), None)]),
  'MNLI/train.tsv': ([MNLI_TRAIN_HEAD + '\tlabel1\tgold_label',
                      '0\t31193\t31193n\tgovernment\t( bp )\t( bp )\t(ROOT)\t(ROOT)\tConceptually cream skimming.'
                      '\tProduct and geography.\tneutral\tneutral',
                      '1\t101457\t101457e\ttelephone\t( bp )\t( bp )\t(ROOT)\t(ROOT)\tyou know during the season'
                      '\tYou lose the things.\tentailment\tentailment'],
                     [('0', ('Conceptually cream skimming.', 'Product and geography.'), cls('mnli', 'neutral')),
                      ('1', ('you know during the season', 'You lose the things.'), cls('mnli', 'entailment'))]),
  'MNLI/dev_matched.tsv': ([MNLI_DEV_HEAD, '0\t63735\t63735n\tslate\tb\tb\tp\tp\tThe new rights.\tEveryone loves them.'
                            '\tneutral\tentailment\tcontradiction\tcontradiction\tcontradiction\tcontradiction'],
                           [('0', ('The new rights.', 'Everyone loves them.'), cls('mnli', 'contradiction'))]),
  'MNLI/dev_mismatched.tsv': ([MNLI_DEV_HEAD, '3\t75290\t75290c\tletters\tb\tb\tp\tp\tYour gift.\tNo gift.'
                               '\tcontradiction\tentailment\tentailment\tentailment\tentailment\tentailment'],
                              [('3', ('Your gift.', 'No gift.'), cls('mnli', 'entailment'))]),
  'MNLI/test_matched.tsv': ([MNLI_TRAIN_HEAD, '8\t31\t31n\tslate\tb\tb\tp\tp\tHe left.\tHe stayed.'],
                            [('8', ('He left.', 'He stayed.'), None)]),
  'MNLI/test_mismatched.tsv': ([MNLI_TRAIN_HEAD, '6\t41\t41e\tverbatim\tb\tb\tp\tp\tA.\tB.'],
                               [('6', ('A.', 'B.'), None)]),
  'QNLI/train.tsv': (['index\tquestion\tsentence\tlabel', '0\tWhen?\tIn 1887.\tnot_entailment'],
                     [('0', ('When?', 'In 1887.'), cls('qnli', 'not_entailment'))]),
  'QNLI/dev.tsv': (['index\tquestion\tsentence\tlabel', '2\tWho?\tShe did.\tentailment'],
                   [('2', ('Who?', 'She did.'), cls('qnli', 'entailment'))]),
  'QNLI/test.tsv': (['index\tquestion\tsentence', '4\tWhere?\tHere.'], [('4', ('Where?', 'Here.'), None)]),
  'RTE/train.tsv': (['index\tsentence1\tsentence2\tlabel', '0\tNo weapons found.\tWeapons found.\tnot_entailment',
                     '1\tA man sleeps.\tA person sleeps.\tentailment'],
                    [('0', ('No weapons found.', 'Weapons found.'), cls('rte', 'not_entailment')),
                     ('1', ('A man sleeps.', 'A person sleeps.'), cls('rte', 'entailment'))]),
  'RTE/dev.tsv': (['index\tsentence1\tsentence2\tlabel', '0\tDana left.\tDana went.\tentailment'],
                  [('0', ('Dana left.', 'Dana went.'), cls('rte', 'entailment'))]),
  'RTE/test.tsv': (['index\tsentence1\tsentence2', '11\tMaude ran.\tMaude moved.'],
                   [('11', ('Maude ran.', 'Maude moved.'), None)]),
  'WNLI/train.tsv': (['index\tsentence1\tsentence2\tlabel', '0\tI stuck a pin.\tThe pin had a hole.\t1'],
                     [('0', ('I stuck a pin.', 'The pin had a hole.'), 1)]),
  'WNLI/dev.tsv': (['index\tsentence1\tsentence2\tlabel', '0\tThe drain is clogged.\tThe hair is clogged.\t0'],
                   [('0', ('The drain is clogged.', 'The hair is clogged.'), 0)]),
  'WNLI/test.tsv': (['index\tsentence1\tsentence2', '5\tIt rained.\tIt was wet.'],
                    [('5', ('It rained.', 'It was wet.'), None)]),
}
SPLITS = [(task.name, split.name, f'{task.folder}/{split.file}.tsv')
          for task in TASKS.values() for split in task.splits]
AX_LINES = ['index\tsentence1\tsentence2', '0\tThe cat sat.\tThe cat did not sit.', '1\tDogs "bark".\tDogs bark.']
AX_EXAMPLES = [('0', ('The cat sat.', 'The cat did not sit.'), None), ('1', ('Dogs "bark".', 'Dogs bark.'), None)]


def write(path, lines, newline='\n', bom=False):
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_bytes(('\ufeff' if bom else '').encode() + (newline.join(lines) + newline).encode('utf-8'))


def write_glue_files(root):
  """Every task's files in GLUE's layouts (FILES), AX under diagnostic/: a GLUE data dir."""
  for file, (lines, _) in FILES.items():
    write(root / file, lines)
  write(root / 'diagnostic' / 'diagnostic.tsv', AX_LINES)
  return root


def triples(data):
  return [(ex.index, ex.texts, ex.label) for ex in data.examples]


@pytest.fixture(scope='module')
def glue_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp('glue')
  for file, (lines, _) in FILES.items():
    write(root / file, lines)
  return root


def test_the_fixture_covers_every_split():
  assert sorted(file for _, _, file in SPLITS) == sorted(FILES)


@pytest.mark.parametrize('task,split,file', SPLITS)
def test_reads_every_split_of_every_task(glue_dir, task, split, file):
  data = read_split(TASKS[task], split, str(glue_dir))
  assert (data.task.name, data.split.name, data.skipped) == (task, split, 0)
  assert triples(data) == FILES[file][1]
  assert all(type(ex.label) is (float if task == 'stsb' else int) for ex in data.examples if ex.label is not None)


@pytest.mark.parametrize('where', ['diagnostic/diagnostic.tsv', 'AX.tsv'])
def test_ax_in_either_place(tmp_path, where):
  write(tmp_path / where, AX_LINES)
  assert split_path(AX, AX.splits[0], tmp_path) == tmp_path / where
  assert triples(read_tsv(AX, 'test', tmp_path)) == AX_EXAMPLES


def test_ax_missing_names_both_places(tmp_path):
  with pytest.raises(ConfigError, match='diagnostic.tsv.*AX.tsv'):
    read_tsv(AX, 'test', tmp_path)


def test_crlf_bom_and_non_ascii(tmp_path):
  write(tmp_path / 'SST-2/train.tsv', ['sentence\tlabel', 'café au lait \t1', 'naïve\t0'], newline='\r\n', bom=True)
  write(tmp_path / 'CoLA/train.tsv', ['gj04\t1\t\tÅngström left.'], newline='\r\n', bom=True)
  assert triples(read_tsv(TASKS['sst2'], 'train', tmp_path)) == [('0', ('café au lait ',), 1), ('1', ('naïve',), 0)]
  # No real layout reads the first field of a header-less file; one that does shows the BOM is gone.
  cola = TASKS['cola']
  split = dataclasses.replace(cola.split('train'), layout=dataclasses.replace(cola.split('train').layout, index=0))
  task = dataclasses.replace(cola, splits=(split,))
  assert triples(read_tsv(task, 'train', tmp_path)) == [('gj04', ('Ångström left.',), 1)]


def test_blank_lines_are_skipped_and_row_numbers_count_examples(tmp_path):
  write(tmp_path / 'SST-2/train.tsv', ['sentence\tlabel', '', 'a\t1', '', 'b\t0'])
  assert triples(read_tsv(TASKS['sst2'], 'train', tmp_path)) == [('0', ('a',), 1), ('1', ('b',), 0)]


def test_malformed_qqp_rows_are_skipped_and_counted(tmp_path):
  # A question holding a newline splits its row in two, neither with six columns (old QQP files).
  write(tmp_path / 'QQP/train.tsv', ['id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate', '1\t2\t3\tWhy?\tHow?\t0',
                                     '4\t5\t6\tWhat is', 'this?\tThat.\t1', '7\t8\t9\tWho?\tWhom?\t1'])
  data = read_tsv(TASKS['qqp'], 'train', tmp_path)
  assert data.skipped == 2
  assert triples(data) == [('1', ('Why?', 'How?'), 0), ('7', ('Who?', 'Whom?'), 1)]


def test_a_malformed_row_elsewhere_names_file_and_line(tmp_path):
  write(tmp_path / 'RTE/train.tsv', ['index\tsentence1\tsentence2\tlabel', '0\tA.\tB.\tentailment', '1\tA.\tB.'])
  with pytest.raises(ConfigError, match=r'RTE/train\.tsv:3 has 3 .* 4'):
    read_tsv(TASKS['rte'], 'train', tmp_path)


def test_data_dir_without_the_task_folder(tmp_path):
  (tmp_path / 'SST-2').mkdir()
  for data_dir in (tmp_path, tmp_path / 'nowhere'):
    with pytest.raises(ConfigError, match=r'has no CoLA/ folder; pass the directory GLUE.s download script wrote'):
      read_tsv(TASKS['cola'], 'train', data_dir)


def test_tsv_without_a_data_dir(tmp_path):
  with pytest.raises(ConfigError, match='needs --data-dir'):
    read_split(TASKS['rte'], 'train', None)


def test_missing_split_file_names_the_path(tmp_path):
  write(tmp_path / 'MNLI/train.tsv', FILES['MNLI/train.tsv'][0])
  with pytest.raises(ConfigError, match=r'MNLI/dev_matched\.tsv is missing; .*download script'):
    read_tsv(TASKS['mnli'], 'dev_matched', tmp_path)


@pytest.mark.parametrize('task,file,lines,found,expected', [
  ('sst2', 'SST-2/train.tsv', ['index\tsentence\tlabel', '0\tgood\t1'], 3, 2),  # a header of the wrong count
  ('cola', 'CoLA/train.tsv', ['Our friends.\t1'], 2, 4),  # header-less: the first row is checked
  ('mnli', 'MNLI/dev_matched.tsv', FILES['MNLI/train.tsv'][0], 12, 16),  # train's layout given as dev
])
def test_a_file_with_the_wrong_columns(tmp_path, task, file, lines, found, expected):
  write(tmp_path / file, lines)
  split = file.split('/')[1][:-4]
  folder = TASKS[task].folder
  with pytest.raises(ConfigError, match=rf"{file} has {found} .*{expected} were expected; .*like {folder}'s {split}"):
    read_tsv(TASKS[task], split, tmp_path)


@pytest.mark.parametrize('task,lines,allowed', [
  ('RTE', ['index\tsentence1\tsentence2\tlabel', '0\tA.\tB.\tentailment', '1\tA.\tB.\tentailed'],
   'entailment, not_entailment'),
  ('STS-B', [STSB_HEAD + '\tscore', '0\tg\tf\ty\t1\ts\ts\tA.\tB.\t4.2', '1\tg\tf\ty\t1\ts\ts\tA.\tB.\tn/a'],
   'a number'),
])
def test_a_bad_label_names_the_line_and_the_labels(tmp_path, task, lines, allowed):
  write(tmp_path / task / 'train.tsv', lines)
  with pytest.raises(ConfigError, match=rf'{task}/train\.tsv:3: label .* not one of {allowed}'):
    read_tsv(TASKS[task.lower().replace('-', '')], 'train', tmp_path)


def test_an_unknown_source():
  with pytest.raises(ConfigError, match='choose tsv .* or tfds'):
    read_split(TASKS['rte'], 'train', '/data', source='csv')


def fake_data_source(monkeypatch, records):
  calls = []

  def data_source(name, *, split, data_dir, download):
    assert download is False  # never a download from inside a fine-tuning run
    calls.append((name, split, data_dir))
    if isinstance(records, Exception):
      raise records
    return records
  monkeypatch.setattr(tfds, 'data_source', data_source)
  return calls


def test_tfds_mnli_label_order_and_bytes(monkeypatch):
  # TFDS numbers MNLI 0 entailment, 1 neutral, 2 contradiction; test splits carry -1.
  calls = fake_data_source(monkeypatch, [
    {'premise': b'It rains.', 'hypothesis': b'It is dry.', 'label': 2, 'idx': 7},
    {'premise': 'Caf\u00e9.'.encode(), 'hypothesis': b'A place.', 'label': 0, 'idx': 8},
    {'premise': b'P.', 'hypothesis': b'H.', 'label': 1, 'idx': 9},
    {'premise': 'str text', 'hypothesis': b'H.', 'label': -1, 'idx': 10}])
  data = read_split(TASKS['mnli'], 'dev_mismatched', 'gs://bucket/tfds', source='tfds')
  assert calls == [('glue/mnli', 'validation_mismatched', 'gs://bucket/tfds')]
  assert triples(data) == [('7', ('It rains.', 'It is dry.'), cls('mnli', 'contradiction')),
                           ('8', ('Café.', 'A place.'), cls('mnli', 'entailment')),
                           ('9', ('P.', 'H.'), cls('mnli', 'neutral')), ('10', ('str text', 'H.'), None)]


def test_tfds_labels_go_through_the_tfds_class_order(monkeypatch):
  # Every task's TFDS order matches its files' today; a task numbered differently must still map by name.
  task = dataclasses.replace(TASKS['rte'], tfds_labels=('not_entailment', 'entailment'))
  fake_data_source(monkeypatch, [{'sentence1': b'A.', 'sentence2': b'B.', 'label': 0, 'idx': 0}])
  assert read_tfds(task, 'train').examples[0].label == cls('rte', 'not_entailment')


def test_tfds_stsb_scores(monkeypatch):
  calls = fake_data_source(monkeypatch, [{'sentence1': b'A.', 'sentence2': b'B.', 'label': 3.8, 'idx': 0},
                                         {'sentence1': b'C.', 'sentence2': b'D.', 'label': -1.0, 'idx': 1}])
  assert triples(read_tfds(TASKS['stsb'], 'test')) == [('0', ('A.', 'B.'), 3.8), ('1', ('C.', 'D.'), None)]
  assert calls == [('glue/stsb', 'test', None)]


@pytest.mark.parametrize('error,message', [
  (tfds.core.registered.DatasetNotFoundError('Dataset glue not found.'), 'no such prepared dataset'),
  (ValueError("Unknown split 'validation_matched'."), 'Unknown split'),
  (FileNotFoundError('/tfds/glue/mnli/dataset_info.json'), '/tfds/glue/mnli/dataset_info.json'),
])
def test_tfds_errors_become_config_errors(monkeypatch, error, message):
  fake_data_source(monkeypatch, error)
  with pytest.raises(ConfigError, match=rf'glue/mnli split validation_matched in --data-dir /tfds: {message}.*'
                                        r'tfds build glue/mnli .*--data_dir=/tfds.*or use --source tsv'):
    read_tfds(TASKS['mnli'], 'dev_matched', '/tfds')
