"""One report, two renderings: `index.md` beside its PNG files, and a self-contained `index.html`
(figures embedded as base64 PNG, CSS inline, nothing fetched from the network).

A report is a list of blocks; each renderer turns every block into its own markup, so the two
files always say the same thing.
"""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass, field

import pandas as pd

from lab.report.figures import Drawn

VERDICT_CLASSES = ("keep", "reject", "inconclusive")

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 1200px;
       padding: 0 1rem; color: #222; line-height: 1.45; }
h1 { font-size: 1.6rem; } h2 { border-bottom: 1px solid #ddd; padding-bottom: .2rem; margin-top: 2.2rem; }
table { border-collapse: collapse; margin: .8rem 0; font-size: .85rem; }
th, td { border: 1px solid #d0d0d0; padding: .25rem .5rem; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
tr.keep td { background: #e3f4e1; } tr.reject td { background: #f9e0e0; } tr.inconclusive td { background: #fdf2d0; }
td.verdict { font-weight: 600; }
img { max-width: 100%; border: 1px solid #eee; }
pre { background: #f6f6f6; padding: .8rem; overflow-x: auto; font-size: .8rem; }
.note { color: #666; font-style: italic; }
details { margin: .8rem 0; } summary { cursor: pointer; font-weight: 600; }
"""


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class Paragraph:
    text: str
    note: bool = False  # said in passing (grey, italic): why something is absent


@dataclass(frozen=True)
class Items:
    items: list[str]


@dataclass(frozen=True)
class TableBlock:
    frame: pd.DataFrame
    row_class: str | None = None  # a column whose value becomes the row's CSS class (verdict colours)


@dataclass(frozen=True)
class FigureBlock:
    drawn: Drawn


@dataclass(frozen=True)
class Code:
    text: str
    language: str = ""


@dataclass(frozen=True)
class Collapsed:
    summary: str
    blocks: list[Block] = field(default_factory=list)


@dataclass(frozen=True)
class Link:
    """A sentence ending in a link to another page of the reports folder (a relative path)."""

    text: str
    label: str
    href: str


Block = Heading | Paragraph | Items | TableBlock | FigureBlock | Code | Collapsed | Link


def markdown(title: str, blocks: list[Block]) -> str:
    return "\n".join([f"# {title}", ""] + [_md(block) for block in blocks])


def _md(block: Block) -> str:
    if isinstance(block, Heading):
        return f"{'#' * block.level} {block.text}\n"
    if isinstance(block, Paragraph):
        return f"_{block.text}_\n" if block.note else f"{block.text}\n"
    if isinstance(block, Items):
        return "".join(f"- {item}\n" for item in block.items)
    if isinstance(block, TableBlock):
        return _md_table(block.frame)
    if isinstance(block, FigureBlock):
        drawn = block.drawn
        if drawn.png is None:
            return f"_{drawn.title}: {drawn.note}_\n"
        return f"![{drawn.title}]({drawn.name}.png)\n" + (f"\n{drawn.note}\n" if drawn.note else "")
    if isinstance(block, Link):
        return f"{block.text} [{block.label}]({block.href})\n"
    if isinstance(block, Code):
        fence = "````" if "```" in block.text else "```"
        return f"{fence}{block.language}\n{block.text.rstrip()}\n{fence}\n"
    return f"**{block.summary}**\n\n" + "\n".join(_md(inner) for inner in block.blocks)


def _md_table(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "_(no rows)_\n"

    def cell(value: object) -> str:
        return _text(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in frame.columns) + " |",
             "| " + " | ".join("---" for _ in frame.columns) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def html_document(title: str, blocks: list[Block]) -> str:
    body = "\n".join(_html(block) for block in blocks)
    return (f"<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{html.escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
            f"<h1>{html.escape(title)}</h1>\n{body}\n</body>\n</html>\n")


def _html(block: Block) -> str:
    if isinstance(block, Heading):
        return f"<h{block.level}>{html.escape(block.text)}</h{block.level}>"
    if isinstance(block, Paragraph):
        return f"<p class=\"note\">{html.escape(block.text)}</p>" if block.note else f"<p>{html.escape(block.text)}</p>"
    if isinstance(block, Items):
        return "<ul>" + "".join(f"<li>{html.escape(item)}</li>" for item in block.items) + "</ul>"
    if isinstance(block, TableBlock):
        return _html_table(block.frame, block.row_class)
    if isinstance(block, FigureBlock):
        drawn = block.drawn
        if drawn.png is None:
            return f"<p class=\"note\">{html.escape(drawn.title)}: {html.escape(drawn.note)}</p>"
        data = base64.b64encode(drawn.png).decode("ascii")
        caption = f"<figcaption>{html.escape(drawn.note)}</figcaption>" if drawn.note else ""
        image = f"<img alt=\"{html.escape(drawn.title)}\" src=\"data:image/png;base64,{data}\">"
        return f"<figure>{image}{caption}</figure>"
    if isinstance(block, Link):
        return f"<p>{html.escape(block.text)} <a href=\"{html.escape(block.href)}\">{html.escape(block.label)}</a></p>"
    if isinstance(block, Code):
        return f"<pre><code>{html.escape(block.text)}</code></pre>"
    inner = "\n".join(_html(b) for b in block.blocks)
    return f"<details><summary>{html.escape(block.summary)}</summary>\n{inner}\n</details>"


def _html_table(frame: pd.DataFrame, row_class: str | None) -> str:
    if frame.empty:
        return "<p class=\"note\">(no rows)</p>"
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in frame.columns)
    rows = []
    for row in frame.itertuples(index=False):
        values = dict(zip(frame.columns, row))
        css = str(values.get(row_class, "")) if row_class else ""
        cells = "".join(f"<td class=\"{html.escape(str(c))}\">{html.escape(_text(v))}</td>" if c == row_class
                        else f"<td>{html.escape(_text(v))}</td>" for c, v in values.items())
        rows.append(f"<tr class=\"{html.escape(css)}\">{cells}</tr>" if css in VERDICT_CLASSES else f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _text(value: object) -> str:
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return ""
    return str(value)
