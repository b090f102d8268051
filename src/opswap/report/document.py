"""A report as a list of blocks, rendered to Markdown and to self-contained HTML.

Building the content once and rendering it twice keeps report.md and
report.html saying the same thing.
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Para:
    text: str


@dataclass
class Bullets:
    items: list[str]


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    align_right: set[int] = field(default_factory=set)  # column indexes holding numbers


@dataclass
class Image:
    filename: str
    png: bytes
    caption: str


Block = Heading | Para | Bullets | Table | Image


def _md_cell(s: str) -> str:
    return str(s).replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: list[Block]) -> tuple[str, dict[str, bytes]]:
    """Markdown text plus the image files it links to (name -> PNG bytes)."""
    out: list[str] = []
    files: dict[str, bytes] = {}
    for b in blocks:
        if isinstance(b, Heading):
            out.append("#" * b.level + " " + b.text)
        elif isinstance(b, Para):
            out.append(b.text)
        elif isinstance(b, Bullets):
            out.append("\n".join(f"- {i}" for i in b.items))
        elif isinstance(b, Table):
            sep = ["---:" if i in b.align_right else "---" for i in range(len(b.headers))]
            lines = [
                "| " + " | ".join(map(_md_cell, b.headers)) + " |",
                "| " + " | ".join(sep) + " |",
            ]
            lines += ["| " + " | ".join(_md_cell(c) for c in r) + " |" for r in b.rows]
            out.append("\n".join(lines))
        elif isinstance(b, Image):
            files[b.filename] = b.png
            out.append(f"![{b.caption}]({b.filename})\n\n*{b.caption}*")
    return "\n\n".join(out) + "\n", files


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;max-width:1100px;margin:2em auto;
padding:0 1em;color:#1d1d1f;line-height:1.45}
h1{border-bottom:2px solid #ddd;padding-bottom:.3em}h2{margin-top:1.8em;border-bottom:1px solid #eee}
table{border-collapse:collapse;margin:1em 0;font-size:.9em}th,td{border:1px solid #ddd;padding:4px 8px}
th{background:#f4f4f6;text-align:left}td.num{text-align:right;font-variant-numeric:tabular-nums}
tr:nth-child(even) td{background:#fafafa}figure{margin:1.5em 0}figcaption{color:#555;font-size:.9em}
img{max-width:100%}.tablebox{overflow-x:auto;max-width:100%}td code{overflow-wrap:anywhere}code{background:#f4f4f6;padding:0 3px;border-radius:3px}
.pass{color:#0a7d2c;font-weight:600}.fail{color:#b00020;font-weight:600}
"""


def _inline(text: str) -> str:
    """Escape, then render `code` and **bold** spans (the only Markdown the report uses)."""
    parts = html.escape(text).split("`")
    for i in range(1, len(parts), 2):
        # long names (rule, module path, site) may wrap after a separator, not mid-word
        parts[i] = "<code>" + re.sub(r"([._+/])", r"\1<wbr>", parts[i]) + "</code>"
    s = "".join(parts)
    bits = s.split("**")
    for i in range(1, len(bits), 2):
        bits[i] = f"<strong>{bits[i]}</strong>"
    s = "".join(bits)
    return s.replace("PASSED", '<span class="pass">PASSED</span>').replace(
        "FAILED", '<span class="fail">FAILED</span>'
    )


def to_html(blocks: list[Block], title: str) -> str:
    """One self-contained HTML page: plots embedded as base64 PNG."""
    body: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            body.append(f"<h{b.level}>{_inline(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            body.append(f"<p>{_inline(b.text)}</p>")
        elif isinstance(b, Bullets):
            body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in b.items) + "</ul>")
        elif isinstance(b, Table):
            head = "".join(f"<th>{_inline(h)}</th>" for h in b.headers)
            rows = []
            for r in b.rows:
                cells = "".join(
                    f'<td class="num">{_inline(str(c))}</td>'
                    if i in b.align_right
                    else f"<td>{_inline(str(c))}</td>"
                    for i, c in enumerate(r)
                )
                rows.append(f"<tr>{cells}</tr>")
            # A wide table scrolls inside its own box instead of pushing the page sideways.
            body.append(
                f'<div class="tablebox"><table><thead><tr>{head}</tr></thead>'
                f"<tbody>{''.join(rows)}</tbody></table></div>"
            )
        elif isinstance(b, Image):
            data = base64.b64encode(b.png).decode("ascii")
            body.append(
                f'<figure><img alt="{html.escape(b.caption)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{_inline(b.caption)}</figcaption></figure>"
            )
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
