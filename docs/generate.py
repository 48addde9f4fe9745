"""Writes the references that must not drift from the code, from the code itself:

  docs/reference/config.md     every config field: type, default, the comment beside it (lm/config.py), by section
  docs/reference/cli.md        every command's help (lm/cli.py's parsers)
  docs/reference/presets.md    the presets by the TPU slice their header names (configs/*.yaml)
  docs/reference/families.md   every model family: its Hugging Face class, decoding, experts and presets
  docs/reference/code-map.md   every module of lm/, bench/ and launch/ with its docstring's first sentence
  docs/index.md, mkdocs.yml    the site's home page (the README) and its navigation (the README's map, in order)

  python docs/generate.py            # rewrite them
  python docs/generate.py --check    # exit 1 naming each one that differs (tests/test_docs.py runs this)
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import os
import re
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REWRITE = 'python docs/generate.py'


# ---------------------------------------------------------------- config fields

def _comments(path: Path) -> dict[tuple[str, str], str]:
  """(class, field) -> the comment beside the field and the comment lines right under it, for each dataclass."""
  lines = path.read_text().splitlines()
  out = {}
  for node in ast.parse(path.read_text()).body:
    if not isinstance(node, ast.ClassDef):
      continue
    for item in node.body:
      if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
        line = lines[item.lineno - 1]
        text = [line.split('  # ', 1)[1]] if '  # ' in line else []
        following = item.end_lineno
        while following < len(lines) and lines[following].strip().startswith('# '):
          text.append(lines[following].strip()[2:])
          following += 1
        out[node.name, item.target.id] = ' '.join(text)
  return out


def _alias_comments(path: Path) -> dict[tuple, str]:
  """A Literal alias's choices -> the comment beside it and the comment lines right above it (lm/config.py)."""
  lines = path.read_text().splitlines()
  out = {}
  for node in ast.parse(path.read_text()).body:
    if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Subscript)
        and getattr(node.value.value, 'id', '') == 'Literal'):
      line = lines[node.lineno - 1]
      text, above = [line.split('  # ', 1)[1]] if '  # ' in line else [], node.lineno - 2
      while '  # ' not in line and above >= 0 and lines[above].startswith('# '):
        text.insert(0, lines[above][2:])
        above -= 1
      out[tuple(ast.literal_eval(node.value.slice))] = ' '.join(text)
  return out


def _mesh_comments() -> dict[str, str]:
  """mesh.<field> -> the comment beside its axis in lm/mesh_axes.py."""
  from lm.mesh_axes import MESH_AXES
  text = (ROOT / 'lm/mesh_axes.py').read_text().splitlines()
  out = {}
  for axis in MESH_AXES:
    line = next(line for line in text if line.strip().startswith(f"MeshAxis('{axis.name}'"))
    out[axis.attr] = line.split('  # ', 1)[1] if '  # ' in line else ''
    if axis.slices_field:
      out[axis.slices_field] = (f'the TPU slices the {axis.name} axis spans too, over the data-center network, '
                                f'mesh.{axis.attr} of it on each')
  return out


def _type(hint: typing.Any) -> str:
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin is typing.Literal:
    return ' \\| '.join(f'`{a}`' for a in args)
  if origin in (typing.Union, getattr(__import__('types'), 'UnionType')):
    inner = [a for a in args if a is not type(None)]
    return ' or '.join(_type(a) for a in inner) + (' or null' if len(inner) < len(args) else '')
  if origin is tuple:
    return f'list of {_type(args[0])}'
  return hint.__name__


def _default(value: typing.Any) -> str:
  if isinstance(value, tuple):
    return '`[' + ', '.join(map(str, value)) + ']`'
  if value is None:
    return '`null`'
  if isinstance(value, bool):
    return f'`{str(value).lower()}`'
  return f'`{value}`' if value != '' else '`""`'


def config_reference() -> str:
  from lm import config
  comments = _comments(ROOT / 'lm/config.py')
  mesh, aliases = _mesh_comments(), _alias_comments(ROOT / 'lm/config.py')
  out = ['# Config reference', '',
         f'Every field of a config, generated from `lm/config.py` by `{REWRITE}` (do not edit). Set any of them in a',
         'preset or on the command line as `section.field=value` ([Configs](../configs.md)); a value of the wrong',
         'type or outside a field\'s choices stops the load with one line naming the field.', '']
  sections: list[tuple[str, type]] = []

  def walk(cls: type, prefix: str) -> None:
    sections.append((prefix, cls))
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
      if dataclasses.is_dataclass(hints[f.name]):
        walk(hints[f.name], f'{prefix}{f.name}.')
  walk(config.Config, '')
  out += ['Sections: ' + ', '.join(f'[`{p[:-1]}`](#{p[:-1].replace(".", "")})' for p, _ in sections[1:]) + '.', '']
  for prefix, cls in sections:
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
      if dataclasses.is_dataclass(hints[f.name]):
        continue
      value = f.default_factory() if f.default is dataclasses.MISSING else f.default
      what = mesh.get(f.name, '') if cls is config.MeshConfig else comments.get((cls.__name__, f.name), '')
      hint = hints[f.name]
      choices = typing.get_args(typing.get_args(hint)[0] if typing.get_origin(hint) is tuple else hint)
      what = what or aliases.get(choices, '')
      what = what.replace('|', '\\|')
      rows.append(f'| `{prefix}{f.name}` | {_type(hints[f.name])} | {_default(value)} | {what} |')
    if not rows:
      continue
    out += [f'## {prefix[:-1] or "top level"}', '']
    doc = cls.__doc__ if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + '(') else ''
    if doc:
      out += [' '.join(doc.split()), '']
    out += ['| field | type | default | what |', '|---|---|---|---|', *rows, '']
  return '\n'.join(out)


# ---------------------------------------------------------------- the CLI

def _parsers(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> list[tuple[str, argparse.ArgumentParser]]:
  out = [(' '.join(words), parser)]
  for action in parser._actions:
    if isinstance(action, argparse._SubParsersAction):
      for name, child in action.choices.items():
        out += _parsers(child, (*words, name))
  return out


def cli_reference() -> str:
  os.environ['COLUMNS'] = '100'  # argparse wraps help at the terminal's width
  from lm.cli import build_parser
  parser = build_parser()
  parser.prog = 'lm'
  out = ['# CLI reference', '',
         f'Every command\'s `--help`, generated from the parsers by `{REWRITE}` (do not edit). The guides show each',
         'command at work; a bad flag or value exits 2 with one line naming it.', '']
  commands = _parsers(parser, ('lm',))
  out += ['Commands: ' + ', '.join(f'[`{w}`](#{w.replace(" ", "-")})' for w, _ in commands[1:]) + '.', '']
  for words, child in commands:
    child.prog = words
    out += [f'## {words}', '', '```text', child.format_help().rstrip(), '```', '']
  return '\n'.join(out)


# ---------------------------------------------------------------- presets by slice

def presets_reference() -> str:
  rows = []
  for path in sorted((ROOT / 'configs').glob('*.yaml')):
    header = [line[2:] for line in path.read_text().splitlines() if line.startswith('# ')]
    slice_line = next(line for line in header if line.startswith('Slice: '))
    match = re.match(r'Slice: (\S+) \((\d+) chips?\): (.*)$', slice_line)
    what = re.split(r' \(|: |; |\. ', header[0], maxsplit=1)[0].rstrip('.')
    rows.append((int(match[2]), match[1], path.stem, what, match[3].rstrip('.')))
  out = ['# Presets by slice', '',
         f'Every preset in `configs/`, by the TPU slice its header names, generated by `{REWRITE}` (do not edit).',
         'Its mesh, remat, microbatches and loss tiles fit that slice as written; [the compiled',
         'table](../results/scaling_table.md) has each one\'s memory per device. `lm compile --config PRESET`',
         'compiles it for its slice, `--topology` for another ([TPU planning](../tpu-planning.md)).', '',
         '| slice | chips | preset | what | layout on the slice |', '|---|---|---|---|---|']
  for chips, slice_name, name, what, layout in sorted(rows, key=lambda r: (r[0], r[1], r[2])):
    out.append(f'| {slice_name} | {chips} | `{name}` | {what} | {layout} |')
  return '\n'.join(out) + '\n'


# ---------------------------------------------------------------- families

def families_reference() -> str:
  import yaml
  from lm.models import FAMILIES
  presets: dict[str, list[str]] = {}
  for path in sorted((ROOT / 'configs').glob('*.yaml')):
    family = _preset_family(path, yaml)
    presets.setdefault(family, []).append(path.stem)
  out = ['# Families', '',
         f'Every model family lm builds, from the records in `lm.models.FAMILIES`, generated by `{REWRITE}` (do not',
         'edit). `lm convert --from-hf` reads the Hugging Face class of each, and `--to-hf` writes it; what each',
         'honours and refuses of a config.json is in [Models and families](../models.md).', '',
         '| family | Hugging Face class | decoding | takes `model.moe` | presets |', '|---|---|---|---|---|']
  for name, record in FAMILIES.items():
    decoding = type(record.decoding).__name__ if record.decoding else ''
    decoding = {'DecoderOnly': 'decoder-only', 'EncoderDecoder': 'encoder-decoder'}.get(decoding, decoding or 'none (an encoder)')
    names = ', '.join(f'`{p}`' for p in presets.get(name, []))
    out.append(f'| `{name}` | `{record.converter().ARCHITECTURE}` | {decoding} | '
               f'{"yes" if record.routed_mlp else ""} | {names} |')
  return '\n'.join(out) + '\n'


def _preset_family(path: Path, yaml) -> str:
  """A preset's model.family, following `base:`."""
  values = yaml.safe_load(path.read_text()) or {}
  family = values.get('model', {}).get('family')
  if family is None and 'base' in values:
    return _preset_family(ROOT / 'configs' / f'{values["base"]}.yaml', yaml)
  return family or 'gpt'


# ---------------------------------------------------------------- the code map

def _first_sentence(path: Path) -> str:
  doc = ast.get_docstring(ast.parse(path.read_text())) or ''
  text = ' '.join(doc.split('\n\n')[0].split())
  match = re.match(r'(.+?\.)(\s|$)', text)
  return (match[1] if match else text).rstrip(':.').replace('|', '\\|')


def code_map() -> str:
  out = ['# Code map', '',
         f'Every module, with the first sentence of its docstring, generated by `{REWRITE}` (do not edit). Imports',
         'go one way ([Contributing](../contributing.md#layout)).', '']
  for folder in ('lm', 'bench', 'launch'):
    out += [f'## {folder}/', '', '| module | what |', '|---|---|']
    for path in sorted((ROOT / folder).rglob('*.py')):
      if '__pycache__' in path.parts:
        continue
      name = str(path.relative_to(ROOT))
      out.append(f'| `{name}` | {_first_sentence(path)} |')
    out.append('')
  return '\n'.join(out)


# ---------------------------------------------------------------- the site

def _map() -> list[tuple[str, str]]:
  """The README's map: (each page's heading, the page under docs/) in the map's order."""
  section = (ROOT / 'README.md').read_text().split('\n## Documentation\n')[1].split('\n## ')[0]
  pages = dict.fromkeys(target[len('docs/'):] for target in re.findall(r'\]\((docs/[^)#]+\.md)\)', section))
  return [(_heading(ROOT / 'docs' / page), page) for page in pages]


def _heading(page: Path) -> str:
  return next(line[2:] for line in page.read_text().splitlines() if line.startswith('# '))


def site_index() -> str:
  readme = (ROOT / 'README.md').read_text()
  readme = re.sub(r'\]\((?![a-z]+:|#|docs/)([^)]+)\)', r'](../\1)', readme)  # the source tree, from docs/
  readme = re.sub(r'\]\(docs/', '](', readme)
  return f'<!-- The README, for the site: generated by `{REWRITE}` (do not edit). -->\n\n' + readme


def mkdocs_yaml() -> str:
  nav = '\n'.join(f'  - "{title}": {page}' for title, page in [('Home', 'index.md'), *_map()])
  return f'''# The documentation site (pip install -e '.[docs]'; mkdocs build or mkdocs serve). Generated by
# `{REWRITE}` from the README's map (do not edit). The pages are plain GitHub Markdown and read on GitHub as well.
site_name: lm
docs_dir: docs
exclude_docs: |
  generate.py
  results/*.py
  results/*.sh
theme:
  name: material
  features: [navigation.sections, search.highlight]
plugins: [search]
markdown_extensions: [tables, admonition, toc]
validation:
  links:
    not_found: info
    unrecognized_links: info
nav:
{nav}
'''


OUTPUTS = {
  'docs/reference/config.md': config_reference,
  'docs/reference/cli.md': cli_reference,
  'docs/reference/presets.md': presets_reference,
  'docs/reference/families.md': families_reference,
  'docs/reference/code-map.md': code_map,
  'docs/index.md': site_index,
  'mkdocs.yml': mkdocs_yaml,
}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description='Write (or --check) the generated references.')
  parser.add_argument('--check', action='store_true', help='exit 1 naming each reference that differs')
  args = parser.parse_args(argv)
  sys.path.insert(0, str(ROOT))
  stale = []
  for name, make in OUTPUTS.items():
    text = make()
    path = ROOT / name
    if args.check:
      if not path.exists() or path.read_text() != text:
        stale.append(name)
    else:
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(text)
  for name in stale:
    print(f'{name} differs from what the code gives: run `{REWRITE}`', file=sys.stderr)
  return 1 if stale else 0


if __name__ == '__main__':
  sys.exit(main())
