"""The documentation site builds in strict mode (mkdocs.yml): no broken link or anchor, every page in the
navigation, every API reference resolved; its search index and API pages hold what they should."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools", "docs"))
import hooks  # noqa: E402

sys.path.pop(0)


def test_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                         capture_output=True, text=True, env=dict(os.environ, NO_MKDOCS_2_WARNING="1"), timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for page in ("index.html", "performance.html", "options.html", "knobs.html", "api/deepspeed_multi.html",
                 "api/accelerate.html", "api/transformers.html", "api/lightning.html"):
        assert (site / page).is_file(), page
    api = (site / "api" / "deepspeed_multi.html").read_text()
    for name in ("initialize", "MultiEngine", "save_checkpoint", "load_checkpoint", "remove_checkpoint", "zero_init",
                 "TrainingState", "is_update_boundary", "generation_mode"):
        assert f'id="deepspeed_multi.{name}' in api or f'.{name}"' in api, name
    index = json.loads((site / "search" / "search_index.json").read_text())
    assert any("remove_checkpoint" in doc["location"] for doc in index["docs"])
    assert any("generation_gather_bytes" in doc["text"] for doc in index["docs"])


def test_links_the_site_rewrites():
    assert hooks._rewrite("docs/limits.md#misuse", "index.md", None) == "limits.md#misuse"
    assert hooks._rewrite("../README.md#four-ways-in", "tests.md", None) == "index.md#four-ways-in"
    assert hooks._rewrite("../../benchmarks/PERFORMANCE.md#x", "api/x.md", None) == "../performance.md#x"
    assert hooks._rewrite("examples/demo.py", "index.md", None) == "repo/examples/demo.py"
    assert hooks._rewrite("examples/demo.py", "index.md", "https://h/o/r") == "https://h/o/r/blob/main/examples/demo.py"
    assert hooks._rewrite("examples/no_such_file.py", "index.md", None) is None  # a warning: strict fails
    assert hooks._rewrite("https://pytorch.org", "index.md", None) == "https://pytorch.org"
