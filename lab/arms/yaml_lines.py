"""YAML that remembers where each value came from, so a refusal can name the line.

PyYAML's composed node tree carries marks; we construct the plain data from the same tree and keep
the tree to answer "which line holds windows[0].arms[1].flags?".
"""

from __future__ import annotations

from typing import Any, Sequence

import yaml

from lab.arms.errors import Problem


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


def _child(node: yaml.Node, part: Any) -> tuple[yaml.Node | None, yaml.Node] | None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode) and key.value == str(part):
                return key, value
    elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
        return None, node.value[part]
    return None


def load(text: str) -> tuple[Located | None, list[Problem]]:
    """Parse `text`; on a syntax error return no data and the problem at its line."""
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
