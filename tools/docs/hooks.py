"""MkDocs hooks (mkdocs.yml): the repository's own Markdown outside docs/ on the site, and its links.

- README.md is the site's home page (index.md) and benchmarks/PERFORMANCE.md its performance page
  (performance.md), read from where they live: one source for the repository view and the site.
- Links are written for the repository view (relative to each file's place in the repository). On the
  site, a link to README.md, PERFORMANCE.md or a page under docs/ becomes a link to that page; a link
  (or image) to another file of the repository (an example, a plot, a log) points at a copy of it under
  repo/ in the site (a folder: a generated listing of its files), or into ``repo_url``'s ``blob/main/``
  when mkdocs.yml sets one. A link to a file the repository does not hold is a warning, which ``mkdocs
  build --strict`` turns into a failed build, as MkDocs does for pages.
- Docstrings name other objects the way Sphinx does (``:class:`~deepspeed_multi.MultiEngine```, as
  DeepSpeed's and PyTorch's do); on the API pages such a role shows as the name in code (the last
  component where the name starts with ``~``).
"""
import logging
import os
import posixpath
import re

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.deepspeed_multi")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUTSIDE_DOCS = {"README.md": "index.md", "benchmarks/PERFORMANCE.md": "performance.md"}
SITE_PAGE = {v: k for k, v in OUTSIDE_DOCS.items()}
LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)", re.M)


REPO = "repo"  # where the site holds its copies of the repository's other files
SKIP = ("__pycache__", ".pyc")


def on_files(files, config):
    for source, page in OUTSIDE_DOCS.items():
        files.append(File.generated(config, page, abs_src_path=os.path.join(ROOT, source)))
    if config.get("repo_url"):
        return files
    pages = [(uri, os.path.join(ROOT, _repo_path(uri))) for uri in
             list(OUTSIDE_DOCS.values()) + [f.src_uri for f in files if f.src_uri.endswith(".md")]]
    wanted = set()
    for uri, path in pages:
        with open(path) as f:
            text = f.read()
        for m in LINK.finditer(text):
            resolved = _resolve(m.group(3), uri)
            if resolved and _is_repo_file(resolved):
                wanted.add(resolved)
    for path in sorted(wanted):
        _add_copy(files, config, path)
    return files


def _add_copy(files, config, path):
    full = os.path.join(ROOT, path)
    if os.path.isfile(full):
        if files.get_file_from_path(f"{REPO}/{path}") is None:
            files.append(File.generated(config, f"{REPO}/{path}", abs_src_path=full))
        return
    entries = sorted(e for e in os.listdir(full) if not e.startswith(".") and not e.endswith(SKIP))
    lines = [f"# {path}/", "", "Files of the repository's `" + path + "/` folder, as the site holds them.", ""]
    for e in entries:
        sub = posixpath.join(path, e)
        if os.path.isdir(os.path.join(ROOT, sub)):
            lines.append(f"- [{e}/]({e}/index.md)")
            _add_copy(files, config, sub)
        else:
            lines.append(f"- [{e}]({e})")
            _add_copy(files, config, sub)
    files.append(File.generated(config, f"{REPO}/{path}/index.md", content="\n".join(lines) + "\n"))


def _is_url_or_anchor(target):
    return re.match(r"^[a-z][a-z0-9+.-]*:", target) is not None or target.startswith("#")


def _resolve(target, page_uri):
    """The repository path a link of the page points at, or None (a URL, an anchor, outside the repository)."""
    if _is_url_or_anchor(target):
        return None
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(_repo_path(page_uri)), target.partition("#")[0]))
    return None if resolved == ".." or resolved.startswith("../") else resolved


def _is_repo_file(resolved):
    return (resolved not in OUTSIDE_DOCS and not resolved.startswith("docs/")
            and os.path.exists(os.path.join(ROOT, resolved)))


def _repo_path(src_uri: str) -> str:
    """Where the page's Markdown lives in the repository (a generated listing: the folder it lists)."""
    if src_uri.startswith(REPO + "/"):
        return src_uri[len(REPO) + 1:]
    return SITE_PAGE.get(src_uri, posixpath.join("docs", src_uri))


def _rewrite(target: str, page_uri: str, repo_url: str):
    """The site's link for ``target`` written in the page ``page_uri``; None for a link to check as is."""
    if _is_url_or_anchor(target):
        return target  # a URL, or an anchor on the same page
    _, _, anchor = target.partition("#")
    anchor = "#" + anchor if anchor else ""
    resolved = _resolve(target, page_uri)
    if resolved is None:
        return None  # outside the repository: MkDocs warns
    site_target = OUTSIDE_DOCS.get(resolved)
    if site_target is None and resolved.startswith("docs/"):
        site_target = resolved[len("docs/"):]  # a page or a file of the docs folder: MkDocs checks it
    if site_target is not None:
        return posixpath.relpath(site_target, posixpath.dirname(page_uri) or ".") + anchor
    if not os.path.exists(os.path.join(ROOT, resolved)):
        return None
    if repo_url:
        return f"{repo_url.rstrip('/')}/blob/main/{resolved}{anchor}"
    copy = f"{REPO}/{resolved}" + ("/index.md" if os.path.isdir(os.path.join(ROOT, resolved)) else "")
    return posixpath.relpath(copy, posixpath.dirname(page_uri) or ".") + anchor


def on_page_markdown(markdown, page, config, files):
    uri = page.file.src_uri
    if uri.startswith(REPO + "/"):
        return markdown  # a generated listing: its links are the site's own
    parts = FENCE.split(markdown)
    # FENCE.split keeps the fence markers: text, marker, code, marker, text, ...; rewrite the text parts only.
    out, inside = [], False
    i = 0
    while i < len(parts):
        part = parts[i]
        if part in ("```", "~~~"):
            inside = not inside
            out.append(part)
            i += 1
            continue
        if not inside:
            def fix(m):
                new = _rewrite(m.group(3), uri, config.get("repo_url"))
                if new is None:
                    log.warning("%s: the link %r points at no file of the repository", _repo_path(uri), m.group(3))
                    return m.group(0)
                return f"{m.group(1)}[{m.group(2)}]({new})"
            part = LINK.sub(fix, part)
        out.append(part)
        i += 1
    return "".join(out)


ROLE = re.compile(r":(?:class|func|meth|data|attr|mod|exc|obj):<code>(~?)([\w.]+)</code>")


def on_page_content(html, page, config, files):
    return ROLE.sub(lambda m: f"<code>{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}</code>", html)
