"""MkDocs hooks: the reference pages generated from the code, so they cannot drift from it.

- ``reference/config.md``: every config key from the schema (``config_keys()`` in
  ``ds_strategy/config/_schema.py``): its dotted name (DeepSpeed's), the other spellings
  accepted, type and allowed values, default and meaning, grouped by section.
- ``reference/cli.md``: each ``ds-strategy`` subcommand's ``--help``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from typing import Any

CONFIG_MARK = "<!-- generated: config keys -->"
CLI_MARK = "<!-- generated: cli -->"
COMMANDS = ("consolidate", "convert", "estimate", "generate", "plot", "env")


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if CONFIG_MARK in markdown:
        markdown = markdown.replace(CONFIG_MARK, config_reference())
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_reference())
    return markdown


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _json(value: Any) -> str:
    """A default as a DeepSpeed JSON writes it (``true``, ``null``, ``"auto"``, ``5e8`` as an
    integer)."""
    try:
        return json.dumps(value)
    except TypeError:
        return str(value)


def config_reference() -> str:
    from ds_strategy.config._schema import config_keys

    out: list[str] = []
    section = None
    for key in config_keys():
        top = key.path.split(".")[0] if "." in key.path else "(top level)"
        if top != section:
            section = top
            out += ["", f"## `{top}`" if top != "(top level)" else "## Top-level keys", ""]
            if key.section_doc and top != "(top level)":
                out += [key.section_doc, ""]
            out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        kind = key.type if not key.choices else " / ".join(f"`{c}`" for c in key.choices)
        if key.choices and key.default is None:
            kind += " / `null`"
        if key.bounds:
            kind += f" ({key.bounds})"
        name = f"`{key.path}`"
        if key.aliases:
            name += "<br>also " + ", ".join(f"`{a}`" for a in key.aliases)
        default = "required" if key.default == "MISSING" else f"`{_json(key.default)}`"
        out.append(f"| {name} | {_cell(kind)} | {_cell(default)} | {_cell(key.doc)} |")
    return "\n".join(out).strip() + "\n"


def cli_reference() -> str:
    from ds_strategy.cli import main

    os.environ.setdefault("COLUMNS", "100")
    out: list[str] = []
    for command in COMMANDS:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            main([command, "--help"])
        text = buf.getvalue().strip()
        if not text:  # a subcommand this version does not have
            continue
        out += [f"## `ds-strategy {command}`", "", "```text", text, "```", ""]
    return "\n".join(out)
