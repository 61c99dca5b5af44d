"""docs/options.md's tables of config keys and DSM_* switches are the ones the code generates."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "docs"))
import reference  # noqa: E402

sys.path.pop(0)


def test_options_page_is_generated_from_the_code():
    with open(reference.PAGE) as f:
        current = f.read()
    assert reference.render(current) == current, "docs/options.md differs from the code: run python " \
                                                  "tools/docs/reference.py"


def test_every_option_and_switch_has_a_row():
    from deepspeed_multi import switches
    from deepspeed_multi.config import MultiOptions
    with open(reference.PAGE) as f:
        text = f.read()
    for name in (f.name for f in MultiOptions.__dataclass_fields__.values() if f.init):
        assert f"| `{name}` |" in text, name
    for name in switches.ALL:
        assert f"| `{name}` |" in text, name
