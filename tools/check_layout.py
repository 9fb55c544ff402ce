"""Check that every page of the built docs site fits a browser window of a given width.

Serves ``site/`` (built by ``make docs``) on localhost, opens every page in headless
Chromium at the given width (1280 px by default) and measures, with a script injected
into each page as it is served:

- the page: ``document.documentElement.scrollWidth`` must not exceed the window width
  less its vertical scrollbar (no horizontal scrollbar for the whole page; Chromium
  runs with a classic 15 px scrollbar, as most desktop browsers have);
- every code block (``pre``), inline ``code``, table and API signature: it must not
  stick out of its container (the article column), and its content must not be wider
  than its box, neither clipped nor behind a horizontal scrollbar (a reader at this
  width never has to scroll a code block sideways). ``--allow-scroll`` relaxes the
  last rule to "wider content must scroll, not spill".

The measurements come back through ``chromium --dump-dom`` (the script writes them
into the page as JSON), so nothing but Chromium and the Python standard library is
needed. Exit status 1 if any page fails, with one line per offending element.

Run: ``make check-layout`` (builds the site first), or
``python tools/check_layout.py [--site site] [--width 1280] [--screenshots DIR]``.
Chromium is found as ``$CHROMIUM``, ``chromium``, ``chromium-browser`` or
``google-chrome``; on Debian, ``apt-get install chromium``. It is not part of
``.ci/run``: CI machines need not have a browser.
"""

from __future__ import annotations

import argparse
import functools
import html
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Injected before </body>: measures once the page (and Material's scripts) have run,
# then writes the result into <pre id="layout-report"> for --dump-dom to carry out.
_PROBE = r"""
<script>
window.addEventListener("load", () => setTimeout(() => {
  const doc = document.documentElement;
  const report = {width: window.innerWidth, clientWidth: doc.clientWidth,
                  scrollWidth: doc.scrollWidth, scrollHeight: doc.scrollHeight, elements: []};
  const column = document.querySelector(".md-content__inner") || document.body;
  const right = column.getBoundingClientRect().right;
  const describe = (el) => {
    const text = (el.innerText || "").trim().split("\n").sort((a, b) => b.length - a.length)[0];
    const heading = [...document.querySelectorAll("h1, h2, h3, h4")]
      .filter((h) => h.compareDocumentPosition(el) & Node.DOCUMENT_POSITION_FOLLOWING).pop();
    return {top: Math.round(el.getBoundingClientRect().top + window.scrollY),
            tag: el.tagName.toLowerCase() + (el.className ? "." + String(el.className)
              .trim().split(/\s+/).join(".") : ""),
            under: heading ? heading.innerText.replace("¶", "").trim() : "",
            text: (text || "").slice(0, 120)};
  };
  const seen = new Set();
  const selectors = "pre, pre > code, .md-typeset :not(pre) > code, table, .doc-signature, img";
  for (const el of column.querySelectorAll(selectors)) {
    if (seen.has(el) || el.closest("[hidden], details:not([open])")) continue;
    seen.add(el);
    const box = el.getBoundingClientRect();
    if (box.width === 0) continue;
    const style = getComputedStyle(el);
    const scrolls = ["auto", "scroll"].includes(style.overflowX);
    // A wide element inside a scrolling wrapper (Material wraps tables in one) is
    // reported as its wrapper scrolling sideways.
    let wrapper = el.parentElement;
    while (wrapper && wrapper !== column
           && !["auto", "scroll"].includes(getComputedStyle(wrapper).overflowX)) {
      wrapper = wrapper.parentElement;
    }
    if (wrapper && wrapper !== column && el.scrollWidth > wrapper.clientWidth + 1) {
      if (!seen.has(wrapper)) {
        seen.add(wrapper);
        report.elements.push({...describe(el), problem: "scrolls sideways",
                              by: el.scrollWidth - wrapper.clientWidth});
      }
      continue;
    }
    // Inline code may end a line a few pixels past the column (its padding).
    const slack = style.display === "inline" ? 5 : 1;
    if (box.right > right + slack) {
      report.elements.push({...describe(el), problem: "sticks out of the column",
                            by: Math.round(box.right - right)});
    } else if (el.scrollWidth > el.clientWidth + 1 && style.display !== "inline") {
      report.elements.push({...describe(el),
                            problem: scrolls ? "scrolls sideways" : "content spills or is clipped",
                            by: el.scrollWidth - el.clientWidth});
    }
  }
  const out = document.createElement("pre");
  out.id = "layout-report";
  out.textContent = JSON.stringify(report);
  document.body.appendChild(out);
}, 300));
</script>
"""

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the site, with the probe injected into every HTML page."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = Path(self.translate_path(self.path))
        if path.is_dir():
            path = path / "index.html"
        if path.suffix != ".html" or not path.is_file():
            super().do_GET()
            return
        body = path.read_text(encoding="utf-8").replace("</body>", _PROBE + "</body>", 1)
        data = body.encode("utf-8")
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass


def find_chromium() -> str:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and (found := shutil.which(name)):
            return found
    raise SystemExit(
        "check_layout: no Chromium found (set $CHROMIUM, or on Debian: apt-get install chromium)"
    )


def pages(site: Path) -> list[str]:
    """URL paths of every page of the site (``index.html`` files, and 404.html)."""
    found = sorted(p.relative_to(site).as_posix() for p in site.rglob("index.html"))
    return [p.removesuffix("index.html") for p in found if not p.startswith("search/")]


def measure(chromium: str, url: str, width: int, height: int, screenshot: Path | None) -> dict:
    with tempfile.TemporaryDirectory(prefix="check-layout-") as profile:
        args = [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={profile}",
            f"--window-size={width},{height}",
            "--virtual-time-budget=5000",
        ]
        proc = subprocess.run(
            [*args, "--dump-dom", url], capture_output=True, text=True, timeout=120
        )
        m = re.search(r'<pre id="layout-report">(.*?)</pre>', proc.stdout, flags=re.S)
        if m is None:
            raise RuntimeError(f"{url}: no layout report from Chromium:\n{proc.stderr[-2000:]}")
        report = json.loads(html.unescape(m.group(1)))
        if screenshot is not None:
            # The whole page: a window as tall as the page (capped), same width.
            tall = min(report["scrollHeight"], 16000)
            args[args.index(f"--window-size={width},{height}")] = f"--window-size={width},{tall}"
            subprocess.run(
                [*args, f"--screenshot={screenshot}", url], capture_output=True, timeout=120
            )
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--site", type=Path, default=ROOT / "site")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=900)
    parser.add_argument(
        "--screenshots", type=Path, help="also save a full-page screenshot of each page here"
    )
    parser.add_argument(
        "--allow-scroll", action="store_true", help="accept code blocks that scroll sideways"
    )
    parser.add_argument("pages", nargs="*", help="only these pages (e.g. errors/)")
    args = parser.parse_args()

    if not (args.site / "index.html").is_file():
        raise SystemExit(f"check_layout: {args.site} has no index.html; run `make docs` first")
    chromium = find_chromium()
    handler = functools.partial(_Handler, directory=str(args.site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/"
    if args.screenshots:
        args.screenshots.mkdir(parents=True, exist_ok=True)

    failures = 0
    try:
        for page in args.pages or pages(args.site):
            shot = None
            if args.screenshots:
                shot = args.screenshots / ((page.strip("/").replace("/", "_") or "index") + ".png")
            report = measure(chromium, base + page, args.width, args.height, shot)
            problems = [
                e
                for e in report["elements"]
                if not (args.allow_scroll and e["problem"] == "scrolls sideways")
            ]
            # The window keeps a classic scrollbar (as on most desktops), so the page must
            # fit the width left beside it: scrollWidth <= clientWidth (< the window's).
            page_overflow = report["scrollWidth"] > min(args.width, report["clientWidth"])
            status = "FAIL" if problems or page_overflow else "ok"
            print(
                f"{status:4} /{page}  (scrollWidth {report['scrollWidth']} px, "
                f"{len(problems)} element(s) too wide)"
            )
            if page_overflow:
                extra = report["scrollWidth"] - report["clientWidth"]
                print(f"     the page scrolls sideways: {extra} px wider than the window")
            for e in problems:
                print(
                    f"     {e['tag']} under '{e['under']}' (y={e['top']}): "
                    f"{e['problem']} by {e['by']} px"
                )
                print(f"         {e['text']}")
            failures += status == "FAIL"
    finally:
        server.shutdown()
    print(f"{failures} page(s) do not fit {args.width} px" if failures else "every page fits")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
