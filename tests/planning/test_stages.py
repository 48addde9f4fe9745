"""`lm info` on a mesh with stages reports the pipeline: the schedule's ticks and bubble as the published formulas
give them, the microbatches a stage holds (GPipe and circular: all of them, every repeat), one microbatch's layer
input per device and what the busiest stage sends, from the batch, the mesh and the compute dtype; its memory
estimate grows with the microbatches as the compiled step's does, GPipe's with every microbatch and 1F1B's
hardly."""
import json

import pytest

from lm import cli

COMMON = ['model.execution.scan_layers=true', 'model.num_layers=8', 'train.global_batch=32', 'data.seq_len=128',
          'model.execution.dtype=bfloat16', 'mesh.data=-1']


@pytest.mark.parametrize('stages, microbatches, repeats', [(4, 8, 1), (2, 4, 2)])
def test_info_reports_the_pipeline(capsys, stages, microbatches, repeats):
  schedule = 'circular' if repeats > 1 else 'gpipe'
  assert cli.main(['info', '--config', 'llama_tiny', '--json', *COMMON, f'mesh.stage={stages}',
                   f'train.microbatches={microbatches}', f'model.execution.pipeline.schedule={schedule}',
                   f'model.execution.pipeline.repeats={repeats}']) == 0
  r = json.loads(capsys.readouterr().out)['pipeline']
  p, m = stages, microbatches
  data = 8 // p
  assert r['ticks'] == 2 * (m * repeats + p - 1)
  assert r['bubble'] == pytest.approx((p - 1) / (repeats * m + p - 1))
  assert r['in_flight'] == m * repeats
  assert r['layers_per_stage'] == 8 // (p * repeats)
  assert r['activation_bytes'] == 32 // m // data * 128 * 256 * 2  # rows a device, positions, d_model, bf16
  # a middle stage hands each microbatch on and each gradient back, every repeat; with two stages the busiest one
  # (either) keeps its last repeat's forward (last stage) or its first repeat's backward (first stage)
  sends = 2 * m * repeats if p > 2 else m * (2 * repeats - 1)
  assert r['sent_bytes'] == sends * r['activation_bytes']
  assert cli.main(['info', '--config', 'llama_tiny', *COMMON, f'mesh.stage={stages}',
                   f'train.microbatches={microbatches}', f'model.execution.pipeline.schedule={schedule}',
                   f'model.execution.pipeline.repeats={repeats}']) == 0
  assert f'{schedule}: {p} stages x {repeats} repeat(s)' in capsys.readouterr().out


def test_info_reports_no_pipeline_without_stages(capsys):
  assert cli.main(['info', '--config', 'llama_tiny', '--json']) == 0
  assert 'pipeline' not in json.loads(capsys.readouterr().out)


@pytest.mark.long(0.4)
def test_the_estimate_grows_with_the_microbatches_as_the_compiled_step(capsys):
  """From 4 to 16 microbatches of 8 rows on 2 stages: the compiled step's temporaries and the estimate's activations
  grow about alike under 1F1B (its stash of at most 3 microbatches, and the batch's inputs), and GPipe's grow more
  than twice as much in both."""
  def growth(schedule: str) -> tuple[int, int]:
    figures = []
    for m in (4, 16):
      assert cli.main(['info', '--compile', '--json', '--config', 'llama_tiny', 'mesh.stage=2', 'mesh.data=1',
                       'mesh.fsdp=4', 'model.num_layers=8', 'model.execution.scan_layers=true', 'data.seq_len=256',
                       'model.execution.remat=full', f'train.microbatches={m}', f'train.global_batch={8 * m}',
                       f'model.execution.pipeline.schedule={schedule}']) == 0
      r = json.loads(capsys.readouterr().out)
      figures.append((r['memory_per_device']['activations (estimate)'], r['compiled_memory_per_device']['temp']))
    return figures[1][0] - figures[0][0], figures[1][1] - figures[0][1]
  (one_f, one_f_compiled), (gpipe, gpipe_compiled) = growth('1f1b'), growth('gpipe')
  assert one_f == pytest.approx(one_f_compiled, rel=0.25)
  assert gpipe > 2 * one_f and gpipe_compiled > 2 * one_f_compiled
