"""Mixture-of-experts throughput and memory: prints two tables, writes JSON.

  python bench/moe.py [--rounds 3] [--steps 4] [--no-tpu] [--out bench/results/moe.json]

On this CPU: train-step tokens/s of `moe_tiny` under each expert compute (dropless through the tiled grouped
matmul, capacity at factor 1.25, every expert on every token) against its dense twin of equal active FLOPs (a
dense MLP as wide as the k chosen experts together), in interleaved rounds (medians). For TPU: mixtral_8x7b's
train step compiled for its slice (v5p-128) with the experts on the fsdp devices only, split over an expert
axis of 8 (the fsdp axis 8: tokens move by ragged all-to-all), with that axis's receive buffers capped at twice an
even share, and on the capacity path (factor 1.25) instead of dropless gmm: per-device memory from XLA's memory
analysis.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from timing import interleaved, time_calls

from lm.config import load_config, preset_slice
from lm.jobs.pretraining import Pretraining
from lm.planning.compile import compile_report
from lm.report import format_bytes, write_json

CPU_VARIANTS = {
  'dense twin (d_ff 352)': ['model.moe.num_experts=0', 'model.moe.experts_per_token=2', 'model.moe.expert_d_ff=null',
                            'model.moe.balance_loss=0.01', 'model.moe.z_loss=0', 'model.d_ff=352'],
  'dropless (tiles)': [],
  'capacity 1.25': ['model.moe.compute=capacity'],
  'every expert (dense)': ['model.moe.compute=dense'],
}
TPU_MESHES = {'fsdp 64': ['mesh.data=1', 'mesh.fsdp=64'],
              'expert 8 x fsdp 8': ['mesh.data=1', 'mesh.expert=8', 'mesh.fsdp=8'],
              'expert 8 x fsdp 8, expert_buffer 2': ['mesh.data=1', 'mesh.expert=8', 'mesh.fsdp=8',
                                                     'model.moe.expert_buffer=2'],
              'capacity 1.25, fsdp 64': ['mesh.data=1', 'mesh.fsdp=64', 'model.moe.compute=capacity']}


def cpu_table(rounds: int, steps: int) -> dict[str, dict[str, float]]:
  trainers = {}
  for name, overrides in CPU_VARIANTS.items():
    trainer = Pretraining(load_config('moe_tiny', overrides + ['train.progress=false']))
    trainers[name] = [trainer, trainer.init_state(), next(trainer.train_batches)]

  def contender(name: str):
    def round_times() -> list[float]:
      slot = trainers[name]

      def step():
        slot[1], metrics = slot[0].train_step(slot[1], slot[2])
        return metrics
      return time_calls(step, steps, warmup=1).times
    return round_times
  medians = interleaved(rounds, {name: contender(name) for name in trainers})
  config = load_config('moe_tiny')
  tokens = config.train.global_batch * config.data.seq_len
  base = statistics.median(medians['dense twin (d_ff 352)'])
  return {name: {'step_s': statistics.median(m), 'tokens_per_sec': tokens / statistics.median(m),
                 'vs_dense_twin': base / statistics.median(m)} for name, m in medians.items()}


def tpu_table() -> dict[str, dict]:
  out = {}
  for name, overrides in TPU_MESHES.items():
    report = compile_report(load_config('mixtral_8x7b', overrides), preset_slice('mixtral_8x7b'))
    out[name] = {'memory_per_device': report['memory_per_device'], 'fits': report['fits'],
                 'topology': report['topology'], 'compile_seconds': report['compile_seconds']}
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--steps', type=int, default=4, help='timed steps per contender and round')
  parser.add_argument('--tpu', action=argparse.BooleanOptionalAction, default=True,
                      help='also compile mixtral_8x7b for its slice in the four ways (about 15 minutes here)')
  parser.add_argument('--out', default=str(Path(__file__).parent / 'results' / 'moe.json'))
  args = parser.parse_args()

  result: dict = {'cpu': cpu_table(args.rounds, args.steps)}
  print('| moe_tiny on this CPU | step s | tokens/s | vs the dense twin |\n|---|---|---|---|')
  for name, r in result['cpu'].items():
    print(f'| {name} | {r["step_s"]:.3f} | {r["tokens_per_sec"]:,.0f} | {r["vs_dense_twin"]:.2f}x |')
  if args.tpu:
    result['tpu'] = tpu_table()
    print('\n| mixtral_8x7b, v5p-128 | GiB/device (arguments + temporaries) | fits |\n|---|---|---|')
    for name, r in result['tpu'].items():
      m = r['memory_per_device']
      gib = lambda n: format_bytes(n, 'GiB', 2, suffix=False)
      print(f'| {name} | {gib(m["total"])} ({gib(m["arguments"])} + {gib(m["temp"])}) | '
            f'{"yes" if r["fits"] else "no"} |')
  print(f'wrote {write_json(args.out, result)}')


if __name__ == '__main__':
  main()
