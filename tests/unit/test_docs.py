"""The README and docs stay true: the config reference matches the code, their commands and files exist."""
from __future__ import annotations

import re
import subprocess
import sys

from tests.helpers import REPO

sys.path.insert(0, str(REPO / "scripts"))


def test_config_reference_is_current():
    from update_config_doc import START, TARGET, render

    page = TARGET.read_text()
    assert START in page, f"{TARGET} lost its config-reference markers"
    assert render(page) == page, "docs/config.md config reference is stale: run `python scripts/update_config_doc.py`"


def test_readme_quickstart_commands_name_real_entry_points():
    readme = (REPO / "README.md").read_text()
    for script in re.findall(r"python ([a-z_]+\.py)", readme):
        assert (REPO / script).is_file(), f"README mentions {script}, which does not exist"
    for path in ("data/corpus", "data/tokenizer", "configs/tiny-llama.json", "evolution.json", "machines.json"):
        assert (REPO / path).exists(), path


def test_scripts_have_help_and_no_import_side_effects(tmp_path):
    for script in ("diloco.py", "diloco_sim.py"):
        out = subprocess.run([sys.executable, str(REPO / script), "--help"], capture_output=True, text=True,
                             timeout=120, cwd=tmp_path)
        assert out.returncode == 0 and "--config" in out.stdout, out.stderr
    # importing the notebook modules reads no config and writes nothing
    code = "import diloco, os; print(sorted(os.listdir('.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_bad_config_is_one_clear_line(tmp_path):
    cfg = tmp_path / "evolution.json"
    cfg.write_text('{"outer": {"lr_": 0.7}}')
    out = subprocess.run([sys.executable, str(REPO / "diloco_sim.py"), "--config", str(cfg)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert "unknown key 'outer.lr_'; did you mean 'outer.lr'?" in out.stderr
    assert "Traceback" not in out.stderr


def test_files_the_docs_name_exist():
    """A path the docs point a reader to (a test, a bench, a module, a config) is a file in the repo: tests moved to
    tests/unit and tests/e2e once and five docs kept the old paths."""
    missing = []
    for f in [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]:
        for m in re.findall(r"(?<![\w/.])((?:tests|bench|train|configs|scripts)/[\w/.-]+\.(?:py|json|md))(?!\w)",
                            f.read_text()):
            if not (REPO / m).exists():
                missing.append(f"{f.name}: {m}")
    assert not missing, missing


_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")


def _anchors(page: str) -> set[str]:
    """The anchors GitHub gives a page: each heading lowercased, markup and punctuation other than `-` and `_`
    dropped, spaces made hyphens, repeats numbered -1, -2, ...; plus explicit `id=`/`name=` anchors."""
    seen: dict[str, int] = {}
    out = set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", page))
    for line in _FENCE.sub("", page).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))     # a link's text only
        text = re.sub(r"<[^>]+>", "", text).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _doc_pages():
    return [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md", REPO / "CONTRIBUTING.md"]


def test_doc_links_resolve():
    """Every relative link of a doc page names a file that exists, and an anchor that the target's headings give:
    a heading renamed or a page moved breaks the links to it, and nothing else would say so."""
    broken = []
    for f in _doc_pages():
        text = _CODE.sub("", _FENCE.sub("", f.read_text()))
        for target in _LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):        # http:, https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            dest = (f.parent / path).resolve() if path else f
            if not dest.exists():
                broken.append(f"{f.relative_to(REPO)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
                broken.append(f"{f.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_anchor_slugs_follow_github():
    page = "# Bytes per round\n## `outer.screen`: the delta screen\n## A, B & C (2x)\n## Bytes per round\n"
    assert _anchors(page) == {"bytes-per-round", "outerscreen-the-delta-screen", "a-b--c-2x", "bytes-per-round-1"}
