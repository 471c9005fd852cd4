"""A YAML loader without the YAML 1.1 traps, and duplicate-key detection.

Implicit typing follows the YAML 1.2 core schema: booleans are only
``true/True/TRUE/false/False/FALSE``; null is ``null/Null/NULL/~`` or empty;
integers are decimal, ``0x..`` or ``0o..``; floats are decimal with optional
exponent, ``.inf`` and ``.nan``. There are no base-60 numbers (``4:00:00``
stays a string), no ``yes/no/on/off`` booleans (``NO`` stays a string) and no
implicit timestamps (dates stay strings for pydantic to parse).
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from .errors import Problem, format_loc
from .nesting import nesting_message, yaml_too_deep

__all__ = ["OverrideLoader", "SpecLoader", "YamlSyntaxError", "YamlTooDeep", "load_yaml", "parse_yaml_value"]


class SpecLoader(yaml.SafeLoader):
    """yaml.SafeLoader with YAML 1.2 core-schema implicit resolution."""

    yaml_implicit_resolvers: dict = {}  # start empty; filled below


SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)
SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:null",
    re.compile(r"^(?:~|null|Null|NULL|)$"),
    ["~", "n", "N", ""],
)
SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"),  # no '_': 1_000 is a string
    list("-+0123456789"),
)
SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)
SpecLoader.add_implicit_resolver("tag:yaml.org,2002:merge", re.compile(r"^(?:<<)$"), ["<"])


def _construct_int(loader: SpecLoader, node: yaml.ScalarNode) -> int:
    text = str(loader.construct_scalar(node)).replace("_", "")
    sign = -1 if text.startswith("-") else 1
    digits = text.lstrip("+-")
    if digits.startswith(("0x", "0X")):
        return sign * int(digits[2:], 16)
    if digits.startswith(("0o", "0O")):
        return sign * int(digits[2:], 8)
    return sign * int(digits, 10)  # "010" is ten, not octal eight


SpecLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


class OverrideLoader(SpecLoader):
    """SpecLoader for ``--set`` values: an integer whose decimal form differs from
    its text (``007``, ``+4``, ``0x1F``, a digest of zeros) stays the text."""


def _construct_exact_int(loader: SpecLoader, node: yaml.ScalarNode) -> int | str:
    text = str(loader.construct_scalar(node))
    number = _construct_int(loader, node)
    return number if str(number) == text else text


OverrideLoader.add_constructor("tag:yaml.org,2002:int", _construct_exact_int)


class YamlSyntaxError(Exception):
    """YAML text that cannot be parsed; ``problem`` is ready to report."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(str(problem))
        self.problem = problem


class YamlTooDeep(YamlSyntaxError):
    """YAML text that nests mappings and lists more than :data:`MAX_NESTING`
    levels deep; ``loc`` is where (keys and list indexes from the document)."""

    def __init__(self, loc: tuple, source: str) -> None:
        message, got, fix = nesting_message()
        super().__init__(Problem(format_loc(loc) if loc else source, f"{message} (got {got}); {fix}"))
        self.loc = loc


def _syntax_problem(exc: yaml.YAMLError, text: str, source: str) -> Problem:
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    reason = getattr(exc, "problem", None) or getattr(exc, "reason", None) or str(exc)
    if mark is not None:
        line, column = mark.line + 1, mark.column + 1
    else:  # ReaderError: only a character position
        position = getattr(exc, "position", 0) or 0
        line = text.count("\n", 0, position) + 1
        column = position - (text.rfind("\n", 0, position) + 1) + 1
    return Problem(f"{source}:{line}:{column}", f"YAML syntax error: {reason}")


def _key_value(loader: yaml.BaseLoader | None, key_node: yaml.ScalarNode) -> Any:
    """The key as the document means it (``16`` and ``0x10`` are one key,
    ``1`` and ``1.0`` too); its text when it cannot be built."""
    if loader is None:
        return key_node.value
    try:
        value = loader.construct_object(key_node)
        hash(value)
        return value
    except Exception:
        return key_node.value


def _duplicate_keys(node: yaml.Node | None, loader: yaml.BaseLoader | None = None) -> list[Problem]:
    problems: list[Problem] = []
    seen_nodes: set[int] = set()

    def walk(current: yaml.Node | None, loc: tuple) -> None:
        if current is None or id(current) in seen_nodes:
            return
        seen_nodes.add(id(current))
        if isinstance(current, yaml.MappingNode):
            first_line: dict[Any, tuple[int, int]] = {}
            for key_node, value_node in current.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    walk(value_node, loc)
                    continue
                key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
                same = _key_value(loader, key_node) if key is not None else None
                here = (key_node.start_mark.line + 1, key_node.start_mark.column + 1)
                if key is not None and same in first_line:
                    (line, column), (line2, column2) = first_line[same], here
                    where = (f"line {line}, columns {column} and {column2}" if line == line2
                             else f"lines {line} and {line2}")
                    problems.append(Problem(
                        format_loc((*loc, key)), f"duplicate key (got it twice, at {where}); keep one"
                    ))
                elif key is not None:
                    first_line[same] = here
                walk(value_node, (*loc, key) if key is not None else loc)
        elif isinstance(current, yaml.SequenceNode):
            for index, item in enumerate(current.value):
                walk(item, (*loc, index))

    walk(node, ())
    return problems


MAX_EXPANDED_NODES = 20_000  # values a document may hold, aliases expanded (a spec holds tens)
MAX_DOCUMENT_CHARS = 256 * 1024  # characters a spec document may have (a spec is a few KB)
MAX_SCALAR_CHARS = 64 * 1024  # characters one value may have


def _expanded_size(node: yaml.Node | None) -> int:
    """How many nodes ``node`` stands for with every alias expanded
    (memoised per node, so a billion-laughs document is measured in linear
    time instead of being built)."""
    sizes: dict[int, int] = {}

    def size(current: yaml.Node) -> int:
        known = sizes.get(id(current))
        if known is not None:
            return known
        sizes[id(current)] = 1  # a cycle counts once
        total = 1
        if isinstance(current, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in current.value)
        elif isinstance(current, yaml.SequenceNode):
            total += sum(size(item) for item in current.value)
        sizes[id(current)] = total
        return total

    return size(node) if node is not None else 0


def load_yaml(text: str, source: str, loader_class: type[SpecLoader] = SpecLoader) -> tuple[Any, list[Problem]]:
    """Parse one YAML document with :class:`SpecLoader` (or ``loader_class``).

    Returns ``(data, problems)`` where problems lists duplicate keys (the
    last value wins in ``data`` so validation can continue).

    Raises:
        YamlSyntaxError: the text is not valid YAML (or holds several
            documents); its problem path is ``SOURCE:LINE:COLUMN``, 1-based.
    """
    if len(text) > MAX_DOCUMENT_CHARS:
        raise YamlSyntaxError(Problem(source, f"the document has {len(text):,} characters; a spec may have at most "
                                              f"{MAX_DOCUMENT_CHARS:,} (put large data in an input, not the spec)"))
    loader = None
    try:
        scan = loader_class(text)  # its reader refuses control characters: inside the error handling
        try:
            deep = yaml_too_deep(scan)
        finally:
            scan.dispose()
        if deep is not None:
            raise YamlTooDeep(deep, source)
        loader = loader_class(text)
        node = loader.get_single_node()
        if _expanded_size(node) > MAX_EXPANDED_NODES:
            raise YamlSyntaxError(Problem(
                source, f"the document holds more than {MAX_EXPANDED_NODES:,} values (aliases expanded); a spec "
                        "holds tens: put large data in an input, not the spec"))
        long = _long_scalar(node)
        if long is not None:
            raise YamlSyntaxError(Problem(f"{source}:{long[0]}:{long[1]}", f"a value of {long[2]:,} characters; at "
                                                                           f"most {MAX_SCALAR_CHARS:,} are allowed"))
        problems = _duplicate_keys(node, loader)
        data = loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as exc:
        raise YamlSyntaxError(_syntax_problem(exc, text, source)) from None
    except RecursionError:
        raise YamlSyntaxError(Problem(source, "YAML syntax error: nested too deeply")) from None
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. an unhashable key
        raise YamlSyntaxError(Problem(source, f"YAML syntax error: {exc}")) from None
    finally:
        if loader is not None:
            loader.dispose()
    return data, problems


def _long_scalar(node: yaml.Node | None) -> tuple[int, int, int] | None:
    """(line, column, length) of the first scalar longer than :data:`MAX_SCALAR_CHARS`."""
    stack, seen = [node], set()
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, yaml.ScalarNode):
            if len(current.value) > MAX_SCALAR_CHARS:
                return current.start_mark.line + 1, current.start_mark.column + 1, len(current.value)
        elif isinstance(current, yaml.MappingNode):
            stack.extend(x for pair in current.value for x in pair)
        elif isinstance(current, yaml.SequenceNode):
            stack.extend(current.value)
    return None


def parse_yaml_value(text: str) -> Any:
    """Parse an override VALUE as a YAML scalar or flow value (``20s``, ``3``, ``[a, b]``).

    As in a spec file, except that an integer whose decimal form differs from
    its text (leading zeros, a leading ``+``, ``0x``/``0o`` forms) stays the
    text: ``--set data[0].sha256=000...0`` keeps its 64 zeros, while ``4``
    and ``-2`` are numbers (:class:`OverrideLoader`).

    Raises:
        ValueError: the text is not valid YAML.
    """
    try:
        data, _ = load_yaml(text, "value", OverrideLoader)
    except YamlSyntaxError as exc:
        raise ValueError(exc.problem.message.removeprefix("YAML syntax error: ")) from None
    return data
