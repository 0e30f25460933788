"""benchmarks/results holds only cited runs: each file is in index.csv and BENCHMARKS.md, and every link resolves:
to a result, and to a section of a page."""

import csv
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
STAMP = re.compile(r"\d{8}T\d{4,6}Z")


def _files():
    return sorted(p.name for p in RESULTS.iterdir() if p.name != "index.csv")


def _key(name: str) -> str:
    """What BENCHMARKS.md's tables name a file by: its timestamp, else its stem."""
    m = STAMP.search(name)
    return m.group(0) if m else name.rsplit(".", 1)[0]


def test_index_lists_exactly_the_files():
    with open(RESULTS / "index.csv", newline="") as f:
        listed = [row["file"] for row in csv.DictReader(f)]
    assert sorted(listed) == _files(), "benchmarks/results/index.csv and the folder differ"


def test_every_file_is_cited_in_benchmarks_md():
    text = (ROOT / "BENCHMARKS.md").read_text()
    uncited = [name for name in _files() if _key(name) not in text]
    assert not uncited, f"not cited in BENCHMARKS.md (cite or remove): {uncited}"


def test_every_link_to_a_result_resolves():
    pages = [ROOT / "BENCHMARKS.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [(page.name, path) for page in pages
              for path in re.findall(r"benchmarks/results/([A-Za-z0-9._-]+\.[a-z]+)", page.read_text())
              if not (RESULTS / path).exists()]
    assert not broken, f"links to results that do not exist: {broken}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: pathlib.Path) -> set[str]:
    """A page's headings' anchors (a repeated heading gets -1, -2, ...), and its explicit <a id="..."> ones."""
    text = page.read_text()
    seen: dict[str, int] = {}
    out = set(re.findall(r'<a id="([^"]+)"', text))
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), flags=re.M):
        slug = _slug(heading)
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def test_every_link_to_a_section_resolves():
    pages = [ROOT / "BENCHMARKS.md", ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            dest = (page.parent / target).resolve() if target else page
            if dest.suffix == ".md" and dest.exists() and anchor not in _anchors(dest):
                broken.append(f"{page.name}: {target}#{anchor}")
    assert not broken, f"links to sections that do not exist: {broken}"
