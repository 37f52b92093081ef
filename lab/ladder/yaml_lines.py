"""YAML that remembers where each value came from, so a refusal can name the line.

PyYAML's composed node tree carries marks; we construct the plain data from the same tree and keep
the tree to answer "which line holds windows[0].arms[1].flags?".

Before anything is composed, one pass over the parser's events (iterative, linear in the text)
bounds the document: its size in bytes, its nesting depth, and what its aliases expand to. PyYAML
shares an aliased node, but everything that walks the data afterwards (the duplicate-key check,
pydantic) visits it once per reference, so a few nested aliases ("billion laughs") would hang the
lab; and PyYAML composes nesting by recursion, so a deep enough value is a RecursionError.
"""

from __future__ import annotations

from typing import Any, Sequence

import yaml

from lab.ladder.errors import Problem

# A ladder is a page of YAML; these bounds are far above any real one and far below what hurts.
MAX_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_VALUES = 100_000


class Located:
    """Plain data parsed from YAML plus the node tree to look up line numbers by path."""

    def __init__(self, data: Any, root: yaml.Node | None) -> None:
        self.data = data
        self.root = root

    def line(self, path: Sequence[Any]) -> int:
        """1-based line of the deepest node reachable along `path`.

        Path elements that are not in the document (a union tag in a pydantic location, a field
        that is missing) are skipped, so the answer is the closest enclosing line.
        """
        node = self.root
        if node is None:
            return 0
        line = node.start_mark.line + 1
        for part in path:
            found = _child(node, part)
            if found is None:
                continue
            key_node, node = found
            line = (key_node or node).start_mark.line + 1
        return line


def dotted(path: Sequence[Any]) -> str:
    """A path into the document as a person writes it: windows[0].arms[1].flags."""
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _child(node: yaml.Node, part: Any) -> tuple[yaml.Node | None, yaml.Node] | None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.value == str(part):
                return key, value
    elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
        return None, node.value[part]
    return None


def load(text: str) -> tuple[Located | None, list[Problem]]:
    """Parse `text`; on a syntax error or a document beyond the bounds return no data and the problem."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_BYTES:
        return None, [Problem(0, f"the file is {size:,} bytes; a ladder may be at most {MAX_BYTES:,}")]
    shape = _shape_problem(text)
    if shape is not None:
        return None, [shape]
    loader = yaml.SafeLoader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        reason = " ".join(str(exc.problem or exc.context or "invalid YAML").split())
        return None, [Problem(mark.line + 1 if mark else 0, f"YAML syntax: {reason}")]
    except yaml.YAMLError as exc:
        return None, [Problem(0, f"YAML syntax: {exc}")]
    finally:
        loader.dispose()
    return Located(data, root), _duplicate_keys(root)


def _duplicate_keys(node: yaml.Node | None) -> list[Problem]:
    """PyYAML keeps the last of two equal keys silently; a ladder with one is ambiguous."""
    problems: list[Problem] = []
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                if key.value in seen:
                    problems.append(Problem(key.start_mark.line + 1, f"duplicate key {key.value!r}"))
                seen.add(key.value)
            problems += _duplicate_keys(value)
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            problems += _duplicate_keys(item)
    return problems


def _shape_problem(text: str) -> Problem | None:
    """The first place where the document nests deeper than MAX_DEPTH or expands (aliases counted
    at their full size) to more than MAX_VALUES values, or where an alias refers to a collection
    that contains it; None when it stays within bounds. Syntax errors are left to the composer."""
    expanded: dict[str, tuple[int, int]] = {}  # anchor -> (values, depth) of the node it names
    open_: list[list[Any]] = []  # per open collection: [anchor, values so far, depth below it]
    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            line = event.start_mark.line + 1
            if isinstance(event, yaml.CollectionStartEvent):
                if len(open_) >= MAX_DEPTH:
                    return Problem(line, f"values nest deeper than {MAX_DEPTH} levels")
                open_.append([event.anchor, 1, 0])
                continue
            if isinstance(event, yaml.CollectionEndEvent):
                anchor, values, below = open_.pop()
                size = (values, below + 1)
            elif isinstance(event, yaml.ScalarEvent):
                anchor, size = event.anchor, (1, 1)
            elif isinstance(event, yaml.AliasEvent):
                if any(entry[0] == event.anchor for entry in open_):
                    return Problem(line, f"alias *{event.anchor} refers to a collection that contains it")
                if event.anchor not in expanded:
                    continue  # an undefined alias: the composer names it
                anchor, size = None, expanded[event.anchor]
            else:
                continue
            if anchor:
                expanded[anchor] = size
            if not open_:
                continue
            top = open_[-1]
            top[1] += size[0]
            top[2] = max(top[2], size[1])
            if len(open_) + size[1] > MAX_DEPTH + 1:
                return Problem(line, f"values nest deeper than {MAX_DEPTH} levels once aliases are expanded")
            if sum(entry[1] for entry in open_) > MAX_VALUES:
                return Problem(line, f"the document expands to more than {MAX_VALUES:,} values through its "
                                     "aliases; write the values out or use fewer aliases")
    except yaml.YAMLError:
        return None
    return None
