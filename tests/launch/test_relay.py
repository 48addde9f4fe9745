"""launch/local.py's relay: gloo's connection notices, written piece by piece by several threads at once, leave
the output whole and nothing of them in it; any other text passes unchanged."""
import io
import os
import random
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / 'launch'))
from local import relay  # noqa: E402


def notice_writes(rank: int, peers: int) -> list[bytes]:
  """One notice as gloo writes it (std::cout, one write per piece; endl writes the newline)."""
  return [b'[Gloo] Rank ', str(rank).encode(), b' is connected to ', str(peers).encode(), b' peer ranks. ',
          b'Expected number of connected peer ranks is : ', str(peers).encode(), b'\n']


def interleaved(streams: list[list[bytes]], rng: random.Random) -> list[bytes]:
  """The writes of several threads in one random order that keeps each thread's own order."""
  streams, out = [list(s) for s in streams], []
  while any(streams):
    out.append(rng.choice([s for s in streams if s]).pop(0))
  return out


def relayed(data: bytes, rng: random.Random) -> bytes:
  """What relay writes for `data` arriving through a pipe in chunks of random sizes."""
  reader, writer = os.pipe()
  sink = io.BytesIO()
  thread = threading.Thread(target=relay, args=(reader, sink))
  thread.start()
  at = 0
  while at < len(data):
    step = rng.randint(1, 40)
    os.write(writer, data[at:at + step])
    at += step
  os.close(writer)
  thread.join(timeout=30)
  assert not thread.is_alive()
  return sink.getvalue()


@pytest.mark.parametrize('seed', range(20))
@pytest.mark.parametrize('line_end', [b'\n', b'\r\n'])
def test_interleaved_notices_leave_nothing_and_the_lines_around_them_whole(seed, line_end):
  rng = random.Random(seed)
  before = b'name: gpt_tiny\rstep 0 [' + b'=' * rng.randint(0, 30) + b']\r'
  after = b'step 0 | val_loss 5.4932\nfinal val_loss 5.31 at step 6\n'.replace(b'\n', line_end)
  threads = [notice_writes(rank=rng.randint(0, 1), peers=rng.choice([1, 3, 11])) for _ in range(rng.randint(1, 4))]
  notices = b''.join(interleaved(threads, rng)).replace(b'\n', line_end)
  assert b'[Gloo]' in notices
  # Notices in two places: between two lines, and in the middle of a progress bar's line.
  data = before + notices + after[:10] + notices + after[10:]
  assert relayed(data, rng) == before + after


@pytest.mark.parametrize('text', [
    b'[Gloo] Rank of this host: 0\n',  # an opener followed by other text
    b'[Gloo] Rank 0 is connected to 1 peer ranks. Expected',  # a notice cut off by the end of the output
    b'loss [Gloo] Rank 0 is connected to 1 peer ranks. and 2\nmore\n',
    b'[Gloo] Rank [Gloo',
])
def test_text_that_only_looks_like_a_notice_passes_unchanged(text):
  assert relayed(text, random.Random(0)) == text
