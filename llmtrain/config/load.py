"""Loading a config: a YAML file (bounded in size, depth and aliases, no duplicate keys)
plus dotted `key.sub=value` overrides, coerced into the schema's types with every problem
collected, each naming its key; then the tree's own checks (`Config.problems`). And the
way back out: the tree as YAML (config.yaml) and as flat scalars (trackers).

An override never loses text to YAML's reading: a key that takes a text gets it as
written, and elsewhere a value whose texts YAML would change (a comment, a folded line
break, an anchor) is refused (`parse_override`). An unknown key is answered with the key
it most likely meant, a name from Transformers with ours (foreign.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from ..errors import ConfigError, shown
from ..files import size_text
from .foreign import FOREIGN
from .schema import Config
from .validate import closest, map_paths, number_problems


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        if typing.get_origin(item) in (Union, types.UnionType):  # data.train: paths or {path, fraction}
            return "a list of strings or {path: ..., fraction: ...} mappings"
        return "a list of " + {str: "strings", int: "integers", float: "numbers"}.get(item, "values")
    if dataclasses.is_dataclass(tp):
        return "a mapping {" + ", ".join(f"{f.name}: ..." for f in dataclasses.fields(tp)) + "}"
    return {str: "a string", int: "an integer", float: "a number", bool: "true/false"}.get(tp, str(tp))


class _EntryProblems(Exception):
    """The problems of a mapping inside a list (a data.train entry), each naming its key."""

    def __init__(self, problems: list[str]):
        self.problems = problems


def _coerce(value: Any, tp: Any, key: str = "") -> Any:
    """Return `value` as type `tp`, or raise TypeError. Strings from the command line
    arrive already parsed by YAML; a few YAML 1.1 quirks (like '2e-5' being a string)
    are mended here. A mapping inside a list becomes its dataclass (`key`: the list's key,
    to name the entry's problems)."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError
        problems: list[str] = []
        entry = _build(tp, value, f"{key}.", problems)
        if problems:
            raise _EntryProblems(problems)
        return entry
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        raise TypeError
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return _coerce(value, arg, key)
            except TypeError:
                continue
        raise TypeError
    if origin is list:
        if not isinstance(value, list):
            raise TypeError
        item, items = typing.get_args(tp)[0], []
        for i, v in enumerate(value):
            if _takes_str(item) and _pair_text(v) is not None and not _fits(v, item):  # [Uppercase: wolf]
                hint = _quote_hint(f"{key}[{i}]", v, entries=value)
                raise _EntryProblems([f"{key}[{i}]: expected {_type_name(item)}, got {shown(v)}{hint}"])
            try:
                items.append(_coerce(v, item, f"{key}[{i}]"))
            except TypeError:  # name the entry, not the whole list
                mapping = isinstance(v, dict) and "path" in v  # data.eval=[{path: ...}]: only data.train's take one
                hint = "; give the path itself (only data.train entries are mappings)" if mapping else ""
                if not hint and _takes_str(item):
                    hint = _quote_hint(f"{key}[{i}]", v, entries=value)
                raise _EntryProblems([f"{key}[{i}]: expected {_type_name(item)}, got {shown(v)}{hint}"]) from None
        return items
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError
    if tp is float:
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            try:
                return float(value)
            except ValueError:
                raise TypeError from None
            except OverflowError:  # an integer beyond any float: Bounds refuses it as not finite
                return math.inf
        raise TypeError
    if tp is str:
        if isinstance(value, str):
            return value
        if value is None:
            return ""
        raise TypeError
    raise TypeError


def _build(cls: type, raw: dict, prefix: str, problems: list[str], root: type | None = None) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    root = root or cls
    kwargs = {}
    for key, value in raw.items():
        full = f"{prefix}{key}"
        if key not in names:
            problems.append(unknown_key_problem(full, str(key), names, prefix, root))
            continue
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, dict):
                problems.append(_section_problem(full, value, tp))
                continue
            kwargs[key] = _build(tp, value, f"{full}.", problems, root)
            continue
        try:
            kwargs[key] = _coerce(value, tp, full)
        except TypeError:
            hint = ""
            if full == "data.train" and isinstance(value, dict) and "path" in value:
                hint = "; a source written as a mapping goes in a list: data.train=[{path: a.jsonl, fraction: 0.5}]"
            elif _takes_str(tp) or (typing.get_origin(tp) is list and _takes_str(typing.get_args(tp)[0])):
                hint = _quote_hint(full, value, list_of=typing.get_origin(tp) is list)
            problems.append(f"{full}: expected {_type_name(tp)}, got {shown(value)}{hint}")
        except _EntryProblems as e:
            problems += e.problems
    return cls(**kwargs)


def unknown_key_problem(full: str, key: str, names: list[str], prefix: str, root: type) -> str:
    """The problem of unknown key `key` (dotted: `full`) among `names`, the keys of its
    section (`prefix`) of the tree `root`, with what it most likely meant: llmtrain's name
    for a name from Transformers or TRL (foreign.FOREIGN), the section that has the key, a
    close spelling, or else the section's keys."""
    if (ours := FOREIGN.get(key)) is not None:
        note = f" ({ours.note})" if ours.note else ""
        if ours.flag:
            return f"{full}: unknown key; {key} is set at launch here: accelerate launch {ours.flag}{note}"
        return f"{full}: unknown key; did you mean '{ours.key}'?{note}"
    elsewhere, close = _in_other_section(key, root, prefix), closest(key, names)
    hint = (
        f"; did you mean '{elsewhere}'? (each key goes in its section)"
        if elsewhere
        else f"; did you mean '{prefix}{close}'?"
        if close
        else f"; valid keys: {', '.join(prefix + n for n in names)}"
    )
    return f"{full}: unknown key{hint}"


def key_for(name: str, schema: type) -> str | None:
    """The dotted key of `schema` named `name` (output_dir, seed: train.seed), when exactly
    one key has that name at the top or in a section; else None."""
    if name in {f.name for f in dataclasses.fields(schema)}:
        return name if key_type(schema, name) is not None else None
    return _in_other_section(name, schema, "")


def _in_other_section(key: str, root: type, prefix: str) -> str | None:
    """'section.key' when exactly one section of the config tree `root` other than `prefix`
    has a key named `key` (a flat `lr=`, as other tools write it, is train.lr here)."""
    hints = typing.get_type_hints(root)
    found = [
        f"{f.name}.{key}"
        for f in dataclasses.fields(root)
        if dataclasses.is_dataclass(hints[f.name])
        and f"{f.name}." != prefix
        and key in {g.name for g in dataclasses.fields(hints[f.name])}
    ]
    return found[0] if len(found) == 1 else None


def _section_problem(dotted: str, value: Any, section: type | None) -> str:
    """A value that is not a mapping, given for a whole section: what to write instead
    (model.lora=true means model.lora.enabled=true)."""
    if isinstance(value, bool) and section is not None and "enabled" in {f.name for f in dataclasses.fields(section)}:
        on = str(value).lower()
        return f"{dotted}: is a section; to turn it {'on' if value else 'off'} set {dotted}.enabled={on}"
    if isinstance(value, str) and value.lstrip().startswith("{"):  # a mapping YAML could not read, kept as text
        return (
            f"{dotted}: {shown(value)} is not a YAML mapping (check its braces and quotes: "
            f"{dotted}={{key: value, ...}}); or set its keys one by one (e.g. {dotted}.<key>=value)"
        )
    return f"{dotted}: is a section; set its keys (e.g. {dotted}.<key>=value), got {shown(value)}"


def _section_type(schema: type | None, dotted: str) -> type | None:
    """The dataclass of the section at `dotted` in `schema`, or None."""
    for part in dotted.split("."):
        if schema is None or not dataclasses.is_dataclass(schema):
            return None
        schema = typing.get_type_hints(schema).get(part)
    return schema if dataclasses.is_dataclass(schema) else None


def _set_dotted(tree: dict, dotted: str, value: Any, schema: type | None = None) -> None:
    """Set tree[a][b][c] = value for 'a.b.c'. A mapping given for a section is merged
    into it key by key (train={lr: 1e-4} changes only train.lr); a value that is not a
    mapping never replaces a section, nor is a section made inside one."""
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError([f"{dotted or '(empty)'}={shown(value)}: the key has an empty part; write key.sub=value"])
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            above = ".".join(parts[: i + 1])
            raise ConfigError([f"{dotted}: {above} is set to {shown(child)}, not a section; set {above} as a section"])
        node = child
    last, old = parts[-1], node.get(parts[-1])
    if isinstance(old, dict) and isinstance(value, dict):
        for key, sub in value.items():
            _set_dotted(old, str(key), sub, _section_type(schema, dotted))
    elif isinstance(old, dict) and value != old:
        raise ConfigError([_section_problem(dotted, value, _section_type(schema, dotted))])
    else:
        node[last] = value


def parse_override(text: str, schema: type | None = None) -> tuple[str, Any]:
    """'train.lr=2e-5' -> ('train.lr', 2e-5). Values are parsed as YAML, so lists work:
    data.train=[a.jsonl,b.jsonl]; but no text is lost to YAML's reading. A key of `schema`
    that takes a text (output_dir, data.system_prompt, model.dtype) gets the text after `=`
    as written (`as_written`), as does a key that takes a text or more (data.train) given
    one; in any other value, a text YAML would change (a comment, a line break folded, an
    anchor) or a list or mapping it cannot read is refused, saying how to quote it."""
    if "=" not in text:
        raise ConfigError([f"{text}: overrides look like key.sub=value (e.g. train.lr=2e-5)"])
    key, raw = text.split("=", 1)
    key = key.strip()
    tp = key_type(schema, key) if schema is not None else None
    if raw == "":
        return key, ""
    if tp is not None and _text_only(tp):
        return key, as_written(key, raw)
    try:
        value = yaml.load(raw, Loader=BoundedLoader)
    except TooLarge as e:
        raise ConfigError([f"{key}: the value given on the command line {e}"]) from None
    except yaml.YAMLError as e:
        if tp is not None and raw.lstrip()[:1] in ("[", "{"):  # a list or mapping meant, for a key that has a type
            why = getattr(e, "problem", None) or e
            raise ConfigError([f"{key}: {shown(raw)} is not valid YAML ({why}); {QUOTE}"]) from None
        return key, raw  # a section's broken mapping is named as such (_section_problem); a number's, as not one
    scalar = not isinstance(value, (list, dict))
    if tp is not None and scalar and _takes_str(tp) and (isinstance(value, str) or not _fits(value, tp)):
        return key, as_written(key, raw)  # data.train=my #1.jsonl, data.eval=2024
    if (why := lost_text(raw)) is not None:
        raise ConfigError([f"{key}: {why}"])
    return key, value


# How to write a list or mapping whose texts YAML cannot read unquoted.
QUOTE = (
    'put its texts in double quotes, e.g. ["What is 7 + 5?", "${X}/b.jsonl"], and the whole override in the '
    "shell's single quotes"
)


def as_written(key: str, raw: str) -> str:
    """The text of an override for a key that takes a text: as written after `=` (spaces,
    `#`, `: `, `&` and line breaks included), unless the whole of it is one quoted YAML
    text ('...' or "...", for escapes such as \\n), which gives that text."""
    if raw.strip()[:1] not in ("'", '"'):
        return raw
    try:
        scalars = [e for e in yaml.parse(raw, Loader=BoundedLoader) if isinstance(e, yaml.ScalarEvent)]
    except yaml.YAMLError:
        return raw
    if len(scalars) != 1 or scalars[0].end_mark.index != len(raw.rstrip()):  # 'a' #b: more than one quoted text
        return raw
    if "\n" in raw.strip():
        raise ConfigError(
            [
                f"{key}: {shown(raw)}: YAML turns a line break inside quotes into a space; write \\n inside "
                "double quotes, or leave the quotes out to keep the text as written"
            ]
        )
    return scalars[0].value


def lost_text(raw: str) -> str | None:
    """What reading `raw` as YAML drops or changes beyond its types, and how to keep it, or
    None: a comment (`#` outside any text), a line break inside a text (YAML folds it into
    a space; a `|` block keeps it), an anchor (`&x`) or alias (`*x`)."""
    events = list(yaml.parse(raw, Loader=BoundedLoader))
    scalars = [e for e in events if isinstance(e, yaml.ScalarEvent)]
    for i, char in enumerate(raw):
        if char == "#" and not any(e.start_mark.index <= i < e.end_mark.index for e in scalars):
            return (
                f"YAML reads {shown(raw[i:].splitlines()[0])} in {shown(raw)} as a comment and drops it; remove it, "
                f'or put the text that holds it in quotes (e.g. ["run #1"]), and the override in the shell\'s quotes'
            )
    for e in events:
        written = raw[e.start_mark.index : e.end_mark.index]
        if isinstance(e, yaml.AliasEvent) or getattr(e, "anchor", None):
            what = f"*{e.anchor} as an alias" if isinstance(e, yaml.AliasEvent) else f"&{e.anchor} as an anchor"
            return f"YAML reads {what} in {shown(raw)}; put the entry in quotes: {_json(written)}"
        if isinstance(e, yaml.ScalarEvent) and e.style != "|" and "\n" in written:
            return (
                f"YAML turns the line break inside {shown(written)} into a space; write the entry in double quotes "
                f"with \\n for the line break: {_json(written.strip())}"
            )
    return None


def key_type(schema: type, dotted: str) -> Any:
    """The type of key `dotted` in `schema`, without its Annotated extras; None for a
    section or a key the schema does not have."""
    tp: Any = schema
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(tp):
            return None
        tp = typing.get_type_hints(tp).get(part)
    return None if tp is None or dataclasses.is_dataclass(tp) else tp


def _text_only(tp: Any) -> bool:
    """A key whose value is one text: str, or a choice among texts (a Literal of strings)."""
    if typing.get_origin(tp) is Literal:
        return all(isinstance(a, str) for a in typing.get_args(tp))
    return tp is str


def _takes_str(tp: Any) -> bool:
    """A key (or list entry) that takes a text, alone or among other types."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return any(_takes_str(a) for a in typing.get_args(tp))
    return _text_only(tp)


def _fits(value: Any, tp: Any) -> bool:
    try:
        _coerce(value, tp)
    except (TypeError, _EntryProblems):
        return False
    return True


def _pair_text(value: Any) -> str | None:
    """'Uppercase: wolf' for {'Uppercase': 'wolf'}: the text a mapping of one pair of plain
    values was written as, unquoted; None for anything else, and for {path: ...}, the shape of
    a data source entry, which is written as a mapping on purpose."""
    if not isinstance(value, dict) or len(value) != 1 or "path" in value:
        return None
    (k, v), plain = next(iter(value.items())), (str, int, float, bool, type(None))
    if not isinstance(k, plain) or not isinstance(v, plain):
        return None
    return f"{k}:" if v is None else f"{k}: {v}"


def _json(text: str) -> str:
    """`text` in double quotes, as YAML reads it back (escapes such as \\n included)."""
    return json.dumps(text, ensure_ascii=False)


def _quoted(entry: Any) -> str:
    return _json(_pair_text(entry) or str(entry))


def _quote_hint(key: str, value: Any, entries: list | None = None, list_of: bool = False) -> str:
    """Why YAML read a text as something else, and how to quote it, for the problem of key
    `key` (a key or list entry that takes a text) given `value`; '' when it is no such case.
    `entries`: the whole list `value` is an entry of; `list_of`: the key takes a list."""
    if (text := _pair_text(value)) is not None:  # [Uppercase: wolf]: the ': ' made a mapping
        listed = entries if entries is not None else [value] if list_of else None
        given = f"[{', '.join(_quoted(e) for e in listed)}]" if listed is not None else _quoted(value)
        base = key.split("[", 1)[0]
        return (
            f"; YAML reads {text} as a mapping, for the ': ' in it: put it in quotes, "
            f"{_quoted(value)} (on the command line: '{base}={given}')"
        )
    if list_of and isinstance(value, str):  # eval.sample_prompts=What is 7 + 5?
        return f"; give a list: '{key}=[{_json(value)}]'"
    kind = "true/false" if isinstance(value, bool) else "a number" if isinstance(value, (int, float)) else None
    if kind is None and isinstance(value, (datetime.date, datetime.datetime)):
        kind = "a date"
    return f"; YAML reads it unquoted as {kind}: put it in quotes for a text" if kind else ""


MAX_CONFIG_BYTES = 1 << 20  # a config file; long texts (a chat template) belong in files of their own
MAX_YAML_DEPTH = 32  # mappings and lists inside each other; a config needs 3 or 4
MAX_YAML_SIZE = 4 << 20  # nodes plus characters of a document, counted with its aliases expanded


class TooLarge(yaml.YAMLError):
    """A YAML document past a bound: nested too deeply, or too large once its aliases are
    expanded (a "billion laughs" document: a few lines whose aliases repeat each other)."""

    def __init__(self, message: str, line: int):
        self.line = line
        super().__init__(message)


class BoundedLoader(yaml.SafeLoader):
    """YAML's safe loader with bounds checked on the composed node graph, before any
    Python object is built: nesting at most MAX_YAML_DEPTH levels (the composer recurses,
    so a deeper document would end in a RecursionError), and at most MAX_YAML_SIZE nodes
    and characters once aliases are expanded (the constructor shares an aliased value, but
    whatever walks the result, an error message quoting it, a comparison, walks it
    expanded). PyYAML bounds neither."""

    _depth = 0

    def compose_node(self, parent, index):
        if self._depth >= MAX_YAML_DEPTH:
            line = self.peek_event().start_mark.line + 1
            raise TooLarge(f"is nested more than {MAX_YAML_DEPTH} levels deep; flatten it", line)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node, {}, set())
        return node


def _expanded_size(node, sizes: dict, open_: set) -> int:
    """Nodes plus scalar characters under `node`, aliases counted each time they occur;
    memoized per node, so it takes time linear in the document as written."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    line = node.start_mark.line + 1
    if key in open_:
        raise TooLarge("holds an alias (*name) inside the value it names; write it out", line)
    open_.add(key)
    if isinstance(node, yaml.ScalarNode):
        size = 1 + len(node.value)
    else:
        children = node.value if isinstance(node, yaml.SequenceNode) else [n for pair in node.value for n in pair]
        size = 1
        for child in children:
            size += _expanded_size(child, sizes, open_)
            if size > MAX_YAML_SIZE:
                raise TooLarge(
                    f"is larger than {MAX_YAML_SIZE} nodes and characters once its aliases (*name) are expanded; "
                    "write the values out instead of repeating aliases",
                    line,
                )
    open_.discard(key)
    sizes[key] = size
    return size


class DuplicateKey(yaml.YAMLError):
    def __init__(self, key, line: int, first: int):
        self.line = line
        super().__init__(f"'{key}' is given twice (first on line {first}); give each key once")


class BadKey(yaml.YAMLError):
    def __init__(self, key, line: int):
        self.line = line
        kind = {list: "a list", dict: "a mapping"}.get(type(key), type(key).__name__)
        super().__init__(f"a key here is {kind}, not a name; keys are plain names such as lr")


class UniqueKeyLoader(BoundedLoader):
    """YAML's safe loader, except that a key given twice in one mapping is an error: the
    plain loader keeps the last, so a second `train:` block would silently replace the
    first. Keys merged in with `<<: *anchor` may be overridden, as YAML intends."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<`, resolved by the loader
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise BadKey(key, line)
            if key in seen:
                raise DuplicateKey(key, line, seen[key])
            seen[key] = line
        return super().construct_mapping(node, deep)


def read_config(path: Path) -> dict:
    """A config file's mapping as written, before overrides and types: bounded in size, depth
    and aliases, no key given twice; every problem one ConfigError naming the file (and line)."""
    try:
        exists, regular = path.exists(), path.is_file()
    except (OSError, ValueError):  # a name too long for a path, or with a null character
        why = f"--config: {shown(str(path))} cannot be a path; give the path of a YAML file"
        raise ConfigError([why]) from None
    if not exists:
        raise ConfigError([f"--config: no such file: {path}"])
    if not regular:
        raise ConfigError([f"--config: {path} is not a regular file; give a YAML file"])
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ConfigError([f"--config: cannot read {path} ({e.strerror}); check its permissions"]) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            [
                f"--config: {path} is larger than {size_text(MAX_CONFIG_BYTES)}, more than any config needs; "
                "put long texts (data.chat_template) in files of their own and give their paths"
            ]
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError([f"{path}:{line}: not UTF-8 text; save the file as UTF-8"]) from None
    try:
        loaded = yaml.load(text, Loader=UniqueKeyLoader)
    except (DuplicateKey, BadKey) as e:
        raise ConfigError([f"{path}:{e.line}: {e}"]) from None
    except TooLarge as e:
        raise ConfigError([f"{path}:{e.line}: the document {e}"]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError([f"{where}: invalid YAML ({getattr(e, 'problem', e)})"]) from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(
            [f"{path}: the top level must be a mapping of sections; write e.g. 'train:' with its keys indented below"]
        )
    return loaded


def set_values(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{dotted key: value} of every key a mapping sets, down to its leaves: a section's keys
    one by one (train={lr: 1e-4} sets train.lr); a list (data.train's entries) is one value."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out |= set_values(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def overridden(overrides: list[str] | tuple, schema: type = Config) -> dict[str, Any]:
    """{dotted key: value} of every key the overrides set (a later one wins): what the command
    line decides over the config file. Where a run's settings came from is read from this and
    the file's `set_values` (cli.run_config)."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, value = parse_override(item, schema)
        out |= set_values({key: value})
    return out


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple = (),
    schema: type = Config,
    sections: dict[str, str] | None = None,
) -> Config:
    """Load a YAML file (optional) and apply dotted overrides into `schema` (Config, or a
    method's extension of it such as preference/config.DPOConfig); validate everything.
    `sections`: the sections other recipes' trees add (dpo, grpo, ...) -> the recipe that
    reads them, so that one given to this recipe is named as that recipe's (methods.sections)."""
    raw: dict = {}
    problems: list[str] = []
    if path is not None:
        path = Path(path)
        raw = read_config(path)
    for item in overrides:
        key, value = parse_override(item, schema)
        _set_dotted(raw, key, value, schema)
    if path is not None and "output_dir" not in raw:  # a run of its own, not one in the default's directory
        raw["output_dir"] = f"runs/{path.stem}"
    own = {f.name for f in dataclasses.fields(schema)}
    for key in [k for k in raw if k not in own and k in (sections or {})]:  # another recipe's own section
        problems.append(
            f"{key}: unknown key for {schema.RECIPE}; {key} settings are {sections[key]}'s: run that recipe, or "
            f"remove the {key} section"
        )
        del raw[key]
    cfg = _build(schema, raw, "", problems)
    expand_paths(cfg, problems)
    # A key whose value was refused keeps its default; its check would call that missing too.
    # A section given as a scalar (model: x) keeps its defaults: its keys are not missing too.
    refused = {re.split(r"[:\[]", q, maxsplit=1)[0] for q in problems}
    problems += [
        q for q in tree_problems(cfg) if not any(q.split(":", 1)[0] == r or q.startswith(f"{r}.") for r in refused)
    ]
    if problems:
        raise ConfigError(problems)
    return cfg


def tree_problems(cfg: Config) -> list[str]:
    """cfg.problems(), where a number out of its range gets that problem alone: a check
    between keys would read the bad value as one meant (eval.every_steps=-1 as an evaluation
    that needs data)."""
    problems, ranges = cfg.problems(), number_problems(cfg)
    out_of_range = {q.split(":", 1)[0] for q in ranges}
    return [q for q in problems if q in ranges or q.split(":", 1)[0] not in out_of_range]


def check(cfg: Config) -> None:
    """Check a tree again after start-up has filled in what the YAML left to it (the demo's
    names resolved to its files, model.attn_implementation=auto to the backend chosen), so
    the config that runs, and that config.yaml records, is one that passes every check."""
    if problems := tree_problems(cfg):
        raise ConfigError(problems)


# $NAME or ${NAME} in a path: an environment variable, as a shell would read it.
ENV_VAR = re.compile(r"\$(?:\{(\w+)\}|(\w+))")


def _expand(value, key: str, problems: list[str]):
    """`~` or `~user` at the start of a path, and `$NAME` / `${NAME}` anywhere in it,
    expanded; a variable that is not set is a problem naming the key (a path with a `$`
    taken as written would be a directory named `$SCRATCH`). Anything else (a hub name,
    inline template text) as it is."""
    if not isinstance(value, str) or "{{" in value or "{%" in value:  # a Jinja template is text, not a path
        return value
    unset = sorted({a or b for a, b in ENV_VAR.findall(value)} - os.environ.keys())
    if unset:
        names = ", ".join(f"${n}" for n in unset)
        problems.append(
            f"{key}: {shown(value)} names the environment variable {names}, which is not set; export it before "
            "launching, or write the path out"
        )
        return value
    return _home(ENV_VAR.sub(lambda m: os.environ[m[1] or m[2]], value))


def _home(value: str) -> str:
    """`~` or `~user` at the start of a path, expanded."""
    return os.path.expanduser(value) if re.match(r"~[\w.-]*(/|$)", value) else value


def expand_paths(cfg: Config, problems: list[str]) -> None:
    """Expand `~` and environment variables in every path key of the tree alike (each key
    marked with a validate.PathKey, in any section, a method's included), whether it came
    from the YAML file or a dotted override (a shell expands them in neither: not inside
    YAML, not after `key=`). Without this, output_dir: ~/runs/x would make a directory
    named `~`."""

    def expand(key: str, value: str, kind) -> str:
        value = _expand(value, key, problems)
        if kind.parts:  # reward_model:~/rm, ~/rewards.py:short: `~` opens any part
            return ":".join(_home(part) for part in value.split(":"))
        return value

    map_paths(cfg, expand)


RESUME_WORDS = ("auto", "none")  # checkpoint.resume's values that are not paths


def absolute_paths(cfg: Config) -> None:
    """Make the tree's local paths absolute, against the working directory the config is
    loaded in, so that no later change of that directory (code of the user's that the run
    imports or calls: a reward function that calls os.chdir, or its thread) moves what the
    run reads or writes. output_dir and a checkpoint.resume path always; any other path key
    where its value names an existing file or directory (a model, data file, template file;
    a part of a grpo.rewards name written as a path: file.py or with a '/'). A hub name, a
    demo name, template text or a missing file stays as written, and so its error names it."""
    try:
        cwd = Path.cwd()
    except OSError:  # a working directory since removed: nothing relative can be found anyway
        return

    def local(value: str, always: bool = False) -> str:
        if not value or os.path.isabs(value):
            return value
        try:
            found = always or os.path.exists(value)
        except ValueError:  # a null character: path_problems names it
            return value
        return str(cwd / value) if found else value

    def absolute(key: str, value: str, kind) -> str:
        if kind.text and "{" in value:  # template text
            return value
        if kind.parts:
            return ":".join(local(p) if p.endswith(".py") or "/" in p else p for p in value.split(":"))
        if key == "output_dir" or (key == "checkpoint.resume" and value not in RESUME_WORDS):
            return local(value, always=True)
        return local(value)

    map_paths(cfg, absolute)


def as_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(as_dict(cfg), sort_keys=False)


def flat_dict(cfg: Config) -> dict:
    """{'train.lr': 2e-5, ...} for trackers, which want scalars."""
    out = {}

    def walk(d: dict, prefix: str):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)

    walk(as_dict(cfg), "")
    return out
