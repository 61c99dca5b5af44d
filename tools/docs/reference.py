"""docs/options.md's two reference tables, generated from the code that reads them.

    python tools/docs/reference.py          # rewrite the tables in docs/options.md
    python tools/docs/reference.py --check  # exit 1 if they differ from the code (tests/unit/test_docs_reference.py)

- The config keys under ``"deepspeed_multi"``: every init field of ``deepspeed_multi.config.MultiOptions``
  (``init=False`` fields are set by the package, not by users), its type and default from the dataclass,
  its meaning from the class docstring's ``Attributes:`` section.
- The ``DSM_*`` environment switches: ``deepspeed_multi.switches.ALL`` in order, each switch's default and
  meaning from ``switches.DOCS``.

Each table sits between a ``<!-- generated: ... -->`` and an ``<!-- end generated: ... -->`` line.
"""
import argparse
import dataclasses
import inspect
import json
import os
import re
import sys
import typing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(ROOT, "docs", "options.md")
CONFIG, SWITCHES = "config keys", "environment switches"


def _type_name(tp) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) is typing.Union and type(None) in args:
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " or null"
    return {bool: "bool", int: "int", float: "number", str: "string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _attributes(doc: str) -> dict:
    """{name: description} of a Google-style ``Attributes:`` section, descriptions joined into one line."""
    section = inspect.cleandoc(doc).split("Attributes:", 1)[1]
    found, name = {}, None
    for line in section.splitlines():
        m = re.match(r"^    (\w+): (.*)$", line)
        if m:
            name = m.group(1)
            found[name] = m.group(2).strip()
        elif line.startswith("        ") and name:
            found[name] += " " + line.strip()
        elif line.strip():
            break
    return found


def config_rows() -> list:
    from deepspeed_multi.config import MultiOptions
    meaning = _attributes(MultiOptions.__doc__)
    hints = typing.get_type_hints(MultiOptions)
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(MultiOptions):
        if not f.init:
            continue
        if f.name not in meaning:
            raise SystemExit(f"MultiOptions.{f.name} has no entry under Attributes: in its docstring")
        rows.append(f"| `{f.name}` | {_type_name(hints[f.name])} | `{json.dumps(f.default)}` | {meaning[f.name]} |")
    extra = sorted(set(meaning) - {f.name for f in dataclasses.fields(MultiOptions) if f.init})
    if extra:
        raise SystemExit(f"MultiOptions documents attributes that are not options: {extra}")
    return rows


def switch_rows() -> list:
    from deepspeed_multi import switches
    missing = [n for n in switches.ALL if n not in switches.DOCS]
    if missing or set(switches.DOCS) - set(switches.ALL):
        raise SystemExit(f"switches.DOCS and switches.ALL differ: missing {missing}, "
                         f"extra {sorted(set(switches.DOCS) - set(switches.ALL))}")
    rows = ["| variable | default | meaning |", "| --- | --- | --- |"]
    rows += [f"| `{name}` | {switches.DOCS[name][0]} | {switches.DOCS[name][1]} |" for name in switches.ALL]
    return rows


def render(text: str) -> str:
    """``text`` (docs/options.md) with both tables regenerated."""
    for what, rows in ((CONFIG, config_rows()), (SWITCHES, switch_rows())):
        begin, end = f"<!-- generated: {what} (tools/docs/reference.py) -->", f"<!-- end generated: {what} -->"
        if begin not in text or end not in text:
            raise SystemExit(f"{PAGE}: the markers {begin!r} and {end!r} are missing")
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = head + begin + "\n\n" + "\n".join(rows) + "\n\n" + end + tail  # blank lines: the table a paragraph
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only check that docs/options.md is up to date")
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    with open(PAGE) as f:
        current = f.read()
    wanted = render(current)
    if args.check:
        if wanted != current:
            print(f"{PAGE} differs from the code: run python tools/docs/reference.py")
            return 1
        return 0
    if wanted != current:
        with open(PAGE, "w") as f:
            f.write(wanted)
        print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
