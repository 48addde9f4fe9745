"""`lm data build`: local JSON-lines, Parquet or text files -> a TFDS dataset in ArrayRecord format (train and
validation).

The result reads like any prepared TFDS dataset (`data.source=tfds data.name=NAME data.data_dir=DIR`),
so a user's own corpus trains exactly like C4. Records are the documents as the local sources
read them (text files cut into pieces of at most `max_chars`), held out for validation by a hash
of their name; the builder class is made on the fly and never registered, so NAME is free.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator, Sequence

from lm.config import ConfigError, DataConfig
from lm.data.sources import Documents, files_source, open_documents


def build_tfds(name: str, patterns: Sequence[str], data_dir: str, *, text_key: str = 'text',
               val_fraction: float = 0.02, max_chars: int = DataConfig.max_chars) -> dict[str, int]:
  """Writes DATA_DIR/NAME/1.0.0; returns the number of records per split."""
  import tensorflow_datasets as tfds
  if not re.fullmatch(r'[a-z][a-z0-9_]*', name):
    raise ConfigError(f'--name {name!r}: a TFDS name is lower snake_case (letters, digits, _), e.g. my_corpus')
  if not patterns:
    raise ConfigError('lm data build needs --from GLOB (JSON lines, Parquet or text files)')
  cfg = DataConfig(source=files_source(patterns), paths=tuple(patterns), text_key=text_key, val_fraction=val_fraction,
                   max_chars=max_chars)
  target = Path(data_dir) / name / '1.0.0'
  if '://' not in data_dir and target.exists():
    raise ConfigError(f'{target} already exists; choose another --name or remove it (nothing was overwritten)')
  splits = {'train': open_documents(cfg, 'train'), 'validation': open_documents(cfg, 'validation')}

  tfds.disable_progress_bar()
  with tfds.core.registered.skip_registration():  # a class made per call: never in TFDS's registry
    class LocalText(tfds.core.GeneratorBasedBuilder):
      VERSION = tfds.core.Version('1.0.0')

      def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict({'text': tfds.features.Text()}),
                                     description=f'Built by lm data build from {", ".join(patterns)}')

      def _split_generators(self, dl_manager: Any) -> dict[str, Iterator]:
        return {split: self._generate_examples(documents) for split, documents in splits.items()}

      def _generate_examples(self, documents: Documents) -> Iterator[tuple[int, dict[str, Any]]]:
        for i in range(len(documents)):
          if (text := documents[i]) is not None:
            yield i, {'text': text}

    builder_class = type(''.join(part.title() for part in name.split('_')), (LocalText,), {'name': name})
  builder_class(data_dir=data_dir, file_format='array_record').download_and_prepare()
  return {split: len(documents) for split, documents in splits.items()}
