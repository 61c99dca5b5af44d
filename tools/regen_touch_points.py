"""Rewrite the touch-point table in docs/design.md from deepspeed_multi/touch_points.tsv (compat.markdown_table)."""
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from deepspeed_multi import compat  # noqa: E402

doc = ROOT / "docs" / "design.md"
text = doc.read_text()
table = re.compile(r"^\| DeepSpeed owner \| names \| how \| our module \| needed for \|\n(?:^\|.*\|\n)+", re.M)
assert len(table.findall(text)) == 1, "expected one touch-point table in docs/design.md"
doc.write_text(table.sub(lambda _: compat.markdown_table() + "\n", text))
