"""YAML in and out for both schemas: files and command-line values read under size and alias limits, dotted
`a.b.c=value` overrides, validation errors as one line (unknown keys with a did-you-mean), and the resolved YAML
a run folder keeps."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Sequence, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from mcorekit.config.values import NOT_UTF8_RE, plain_argument, shown, text_problem
from mcorekit.errors import ConfigError, first_line

Schema = TypeVar("Schema", bound=BaseModel)


def _suggest(word: str, options: list[str]) -> str:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(options)}"


def _schema_at(schema: type[BaseModel], path: list[str]) -> type[BaseModel] | None:
    for part in path:
        field = schema.model_fields.get(part)
        ann = field.annotation if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return None
        schema = ann
    return schema


def short_repr(value: Any, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters with "..." where longer (values quoted in one-line errors)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _format_errors(err: ValidationError, schema: type[BaseModel], source: str,
                   overrides: Sequence[str] = ()) -> ConfigError:
    """One line for every error; a value that a command-line override set is said to come from it, not the file."""
    overridden = [item.split("=", 1)[0].strip() for item in overrides]
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        where = ".".join(loc)
        by = next((k for k in reversed(overridden) if where == k or where.startswith(k + ".")), None)
        if by is not None and e["type"] != "extra_forbidden":
            where = f"{where} (from the override {by}=...)"
        if e["type"] == "extra_forbidden":
            parent = _schema_at(schema, loc[:-1])
            options = sorted(parent.model_fields) if parent else []
            lines.append(f"unknown key {where!r}{_suggest(loc[-1], options)}")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg} (got {short_repr(e.get('input'))})" if where else msg)
    return ConfigError(f"{shown(source)}: " + "; ".join(lines))


# Limits for every YAML we read (files and command-line values): a few anchors can otherwise expand into
# billions of values ("billion laughs") and exhaust memory long before validation would refuse them.
MAX_YAML_BYTES = 1_000_000
MAX_YAML_ALIASES = 100
MAX_YAML_VALUES = 100_000  # scalars, lists and mappings, counted with every alias expanded
MAX_YAML_DEPTH = 64


class YamlLimitError(ConfigError):
    """A YAML text is over one of the limits above (never retried as a plain string)."""


class RepeatedKeyError(ConfigError):
    """A YAML mapping gives one key twice (never retried as a plain string either)."""


class InvalidYamlError(ConfigError):
    """A text is not valid YAML (a command-line value may then be taken as plain text: see parse_value)."""


def _yaml_children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_yaml_graph(root: yaml.Node, source: str) -> None:
    """Refuse a composed document (aliases still shared, nothing built yet) whose aliases are too many, recursive,
    or expand to too many values; a walk over the shared graph costs no more than the text itself."""
    values: dict[int, int] = {}  # id(node) -> values once expanded, for nodes already walked
    on_path = {id(root)}
    stack = [(root, iter(_yaml_children(root)))]
    aliases = 0
    while stack:
        node, children = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            on_path.discard(id(node))
            if isinstance(node, yaml.MappingNode):
                _no_repeated_keys(node, source)
            values[id(node)] = 1 + sum(values[id(c)] for c in _yaml_children(node))
            if values[id(node)] > MAX_YAML_VALUES:
                raise YamlLimitError(f"{source}: holds more than {MAX_YAML_VALUES:,} values once its aliases (*name) are "
                                     f"expanded; write the values out instead of nesting aliases")
            continue
        if id(child) in on_path:
            raise YamlLimitError(f"{source}: an alias refers to a value that contains it (recursive); remove the alias")
        if id(child) in values:  # reached a second time: an alias
            aliases += 1
            if aliases > MAX_YAML_ALIASES:
                raise YamlLimitError(f"{source}: uses more than {MAX_YAML_ALIASES} aliases (*name); write the values out")
            continue
        if len(stack) >= MAX_YAML_DEPTH:
            raise YamlLimitError(f"{source}: nested more than {MAX_YAML_DEPTH} levels deep")
        on_path.add(id(child))
        stack.append((child, iter(_yaml_children(child))))


def _no_repeated_keys(node: yaml.MappingNode, source: str) -> None:
    """PyYAML keeps the last of two equal keys without a word; a key written twice is an edit gone wrong."""
    seen: dict[str, int] = {}
    for key, _ in node.value:
        if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
            line = key.start_mark.line + 1
            if key.value in seen:
                raise RepeatedKeyError(f"{source}: key {key.value!r} is given twice (lines {seen[key.value]} and "
                                       f"{line}); keep one")
            seen[key.value] = line


def _yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is not None and problem:
        return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    return " ".join(str(e).split())


_SAFE_LOADER = yaml.CSafeLoader if yaml.__with_libyaml__ else yaml.SafeLoader


class _Loader(_SAFE_LOADER):  # type: ignore[misc,valid-type]
    """yaml.safe_load's loader with YAML 1.2's core types for plain scalars, what people and most tools expect:
    true/false are the booleans (yes, no, on, off stay text), no base-60 numbers (1:00:00 stays the Slurm time it was
    written as, not 3600), no leading-zero octals, 1e-4 is a number, dates stay text."""


class _Dumper(yaml.SafeDumper):
    """yaml.safe_dump's dumper, quoting what _Loader would read as another type (and only that)."""


def _core_types(cls: type) -> None:
    """Replace cls's plain-scalar types by YAML 1.2 core's (see _Loader)."""
    cls.yaml_implicit_resolvers = {  # type: ignore[attr-defined]
        first: [(tag, rx) for tag, rx in resolvers
                if tag.rsplit(":", 1)[-1] not in ("bool", "int", "float", "timestamp")]
        for first, resolvers in _SAFE_LOADER.yaml_implicit_resolvers.items()}
    cls.add_implicit_resolver("tag:yaml.org,2002:bool",  # type: ignore[attr-defined]
                              re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    cls.add_implicit_resolver("tag:yaml.org,2002:int",  # type: ignore[attr-defined]
                              re.compile(r"^(?:[-+]?(?:0|[1-9][0-9]*)|0x[0-9a-fA-F]+)$"), list("-+0123456789"))
    cls.add_implicit_resolver(  # type: ignore[attr-defined]
        "tag:yaml.org,2002:float",
        re.compile(r"^(?:[-+]?(?:(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?|[0-9]+[eE][-+]?[0-9]+)"
                   r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
        list("-+0123456789."))


_core_types(_Loader)
_core_types(_Dumper)


def parse_yaml(text: str, source: str) -> Any:
    """yaml.safe_load with the limits above; `source` names the text in messages. Invalid YAML -> ConfigError."""
    if len(text) > MAX_YAML_BYTES:
        raise YamlLimitError(f"{source}: {len(text):,} characters; YAML above {MAX_YAML_BYTES:,} is refused")
    if NOT_UTF8_RE.search(text):  # libyaml takes UTF-8 only: it would raise UnicodeEncodeError
        raise ConfigError(f"{source}: {short_repr(text)} {text_problem(text)}; use UTF-8")
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml_graph(node, source)
        return loader.construct_document(node)
    except yaml.YAMLError as e:
        raise InvalidYamlError(f"{source}: not valid YAML: {_yaml_problem(e)}") from None
    except RecursionError:
        raise YamlLimitError(f"{source}: nested too deeply") from None
    except ValueError as e:  # an integer of more digits than Python converts (4300)
        raise YamlLimitError(f"{source}: {first_line(e)}") from None
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML file whose top level is a mapping; anything else is a ConfigError naming the file."""
    p = Path(path)
    name = shown(p)
    if not p.exists():
        raise ConfigError(f"config file not found: {name}")
    if not p.is_file():
        raise ConfigError(f"{name}: not a file; give a YAML file")
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_YAML_BYTES + 1)  # bounded even where stat lies (/proc) or the file grows
    except OSError as e:
        raise ConfigError(f"{name}: cannot read: {e.strerror}") from None
    if len(raw) > MAX_YAML_BYTES:
        raise YamlLimitError(f"{name}: larger than {MAX_YAML_BYTES:,} bytes; YAML files above that are refused")
    if b"\0" in raw:
        raise ConfigError(f"{name}: contains NUL bytes, so it is not a text file; give a YAML file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{name}: not UTF-8 text (byte {e.start}); give a YAML file") from None
    data = parse_yaml(text, name)
    if data is None:
        raise ConfigError(f"{name}: is empty; expected `key: value` lines")
    if not isinstance(data, dict):
        kind = type(data).__name__
        raise ConfigError(f"{name}: expected a mapping (`key: value` lines) at the top level, got "
                          f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}")
    return data


QUOTED_OR_FLOW = ('"', "'", "[", "{")  # how a YAML quoted string, list or mapping starts


def parse_value(raw: str, source: str) -> Any:
    """A command-line value parsed as YAML (2 -> int, true -> bool, [1,2] -> list); other text that is not valid
    YAML stays a string, but the size and alias limits still apply. A quoted string that is not valid YAML, or a
    list or mapping never closed, is an error: as plain text it would be a wrong string."""
    if not raw.strip():
        return raw
    try:
        return parse_yaml(raw, source)
    except InvalidYamlError as e:
        if _left_open(raw):
            raise ConfigError(f"{e}; a value that starts with a quote or bracket is read as YAML: close the quote or "
                              f"bracket in {short_repr(raw)}, or quote the whole value") from None
        return raw


def _left_open(raw: str) -> bool:
    """Whether `raw`, not valid YAML, starts a quoted string (`"/my dir`, `"/a"b`) or a list or mapping it never
    closes (`[a, b`): taken as plain text it would be a wrong value. A list closed before more text (`[ablation] lr
    3e-4`, a run's name) stays text."""
    text = raw.strip()
    if text.startswith(('"', "'")):
        return True
    return text.startswith(("[", "{")) and text.count("[") + text.count("{") > text.count("]") + text.count("}")


def apply_overrides(data: dict[str, Any], overrides: list[str], schema: type[BaseModel]) -> dict[str, Any]:
    """Apply `a.b.c=value` strings; the value is parsed as YAML (so 2 is an int, true a bool, [1,2] a list)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        plain_argument(item, "override")  # YAML would fold a raw newline into a space and hide it
        key, raw = item.split("=", 1)
        path = key.strip().split(".")
        node_schema: type[BaseModel] | None = schema
        node = data
        for i, part in enumerate(path):
            if node_schema is not None:
                if part not in node_schema.model_fields:
                    where = ".".join(path[: i + 1])
                    raise ConfigError(f"override {item!r}: unknown key {where!r}{_suggest(part, sorted(node_schema.model_fields))}")
                node_schema = _schema_at(node_schema, [part])
            if i == len(path) - 1:
                node[part] = parse_value(raw, f"override {key.strip()!r}")
            else:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ConfigError(f"override {item!r}: {'.'.join(path[: i + 1])} is not a section")
    return data


def load(schema: type[Schema], path: str | Path, overrides: list[str] | None = None) -> Schema:
    """A YAML file with overrides applied, validated against `schema`; every error as one ConfigError line."""
    return validate(schema, apply_overrides(read_yaml(path), overrides or [], schema), str(path), overrides or [])


def validate(schema: type[Schema], data: Any, source: str, overrides: Sequence[str] = ()) -> Schema:
    """schema.model_validate(data), every error as one ConfigError line naming `source` (and the overrides)."""
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise _format_errors(e, schema, source, overrides) from None


def dump(model: BaseModel) -> str:
    """YAML that _Loader reads back as the same values (a string such as "1e5" quoted)."""
    data = model.model_dump(mode="json")
    _refuse_not_utf8(data, "")
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False)


def _refuse_not_utf8(value: Any, where: str) -> None:
    """A ConfigError naming the key whose text is not UTF-8: the dumper would write it as an escape (\\uDCFF)
    that no reader takes back, so the run's config.yaml or cluster.yaml could not be read again."""
    if isinstance(value, dict):
        for key, item in value.items():
            _refuse_not_utf8(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for item in value:
            _refuse_not_utf8(item, where)
    elif isinstance(value, str) and NOT_UTF8_RE.search(value):
        raise ConfigError(f"{where} {value!r} {text_problem(value)}; a run's files are UTF-8: use UTF-8 names")
