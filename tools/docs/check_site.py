"""Look at the built documentation site in a real headless browser: ``make docs-check``.

    python tools/docs/check_site.py --site site --out site-check [--browser chromium] [--width 1366]

Serves the site over HTTP (as a host would: Material's search loads its index by fetch, which file://
refuses), then for each page of PAGES asks the browser for the page as rendered (its DOM after the
scripts ran) and a screenshot at a laptop's width. A page fails when the rendered DOM lacks its title,
the site's navigation or its search box, when the page is wider than the window (a table or code block
that does not fit and is not scrolled inside its own box), or when the screenshot is missing or blank.
Screenshots go to <out>/<name>.png; look at them.

Needs a Chromium (Debian: ``apt-get install chromium``); says so when none is found.
"""
import argparse
import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading

# (screenshot name, page, text the rendered page must show)
PAGES = [
    ("landing", "index.html", "Four ways in"),
    ("api", "api/deepspeed_multi.html", "remove_checkpoint"),
    ("knobs", "knobs.html", "DeepSpeed knobs"),
    ("options", "options.html", "generation_gather_bytes"),
]
# The page's own width, measured by the browser after layout, written into the DOM where --dump-dom sees it.
MEASURE = ("<script>addEventListener('load',()=>{document.body.setAttribute('data-scroll-width',"
           "document.documentElement.scrollWidth)})</script>")


def _browser(name):
    for candidate in ([name] if name else ["chromium", "chromium-browser", "google-chrome"]):
        path = shutil.which(candidate)
        if path:
            return path
    raise SystemExit("no Chromium found: install Debian's `chromium` (apt-get install chromium) or pass --browser")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _serve(root):
    handler = functools.partial(_Quiet, directory=root)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _chromium(browser, width, height, *args):
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--disable-dev-shm-usage",
           f"--window-size={width},{height}", "--virtual-time-budget=4000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def _probe_name(page):
    return page[:-len(".html")] + ".probe.html"


def check_page(browser, base, out, name, page, must_show, width, height):
    problems = []
    # The page's copy with the width probe, beside it (its relative links resolve alike).
    dom = _chromium(browser, width, height, "--dump-dom", f"{base}/{_probe_name(page)}")
    text = dom.stdout
    if dom.returncode != 0 or "<body" not in text:
        return [f"{page}: the browser rendered nothing (rc {dom.returncode}): {dom.stderr[-400:]}"]
    if must_show not in text:
        problems.append(f"{page}: the rendered page does not show {must_show!r}")
    if 'class="md-nav' not in text:
        problems.append(f"{page}: no navigation (md-nav) in the rendered page")
    if 'class="md-search' not in text:
        problems.append(f"{page}: no search box in the rendered page")
    marker = 'data-scroll-width="'
    if marker in text:
        scroll = int(text.split(marker, 1)[1].split('"', 1)[0])
        if scroll > width + 2:
            problems.append(f"{page}: the page is {scroll} px wide at a {width} px window (something does not fit)")
    else:
        problems.append(f"{page}: the width probe did not run")
    shot = os.path.join(out, f"{name}.png")
    if os.path.exists(shot):
        os.remove(shot)
    run = _chromium(browser, width, height, f"--screenshot={shot}", f"{base}/{page}")
    if run.returncode != 0 or not os.path.exists(shot) or os.path.getsize(shot) < 10_000:
        problems.append(f"{page}: no screenshot, or a blank one ({shot}): {run.stderr[-400:]}")
    return problems


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--site", default="site")
    ap.add_argument("--out", default="site-check")
    ap.add_argument("--browser", default=None)
    ap.add_argument("--width", type=int, default=1366)
    ap.add_argument("--height", type=int, default=900)
    args = ap.parse_args(argv)
    browser = _browser(args.browser)
    site = os.path.abspath(args.site)
    if not os.path.exists(os.path.join(site, "index.html")):
        raise SystemExit(f"{site} holds no built site: run make docs")
    os.makedirs(args.out, exist_ok=True)
    # The width probes: each checked page copied beside itself with MEASURE before </body>; removed at the end.
    probes = []
    for _, page, _ in PAGES:
        with open(os.path.join(site, page)) as f:
            html = f.read()
        probes.append(os.path.join(site, _probe_name(page)))
        with open(probes[-1], "w") as f:
            f.write(html.replace("</body>", MEASURE + "</body>", 1))
    server = _serve(site)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    problems = []
    try:
        for name, page, must_show in PAGES:
            found = check_page(browser, base, os.path.abspath(args.out), name, page, must_show, args.width,
                               args.height)
            problems += found
            print(f"{page}: {'ok' if not found else 'FAILED'} -> {os.path.join(args.out, name + '.png')}")
    finally:
        server.shutdown()
        for probe in probes:
            os.remove(probe)
    for p in problems:
        print("  " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
