"""Build the shipped calibration mix (calibration_data/mix-v1/) and the evaluation set (evals/data/eval-v1/).

Run once by a maintainer; the files it writes are committed with their manifests (provenance, licence,
sha256 of every part and of every source document). Sources, all licence-clean and reachable from a
Debian mirror or this machine:

- technical prose in six languages: Debian Reference (`debian-reference-{en,zh-cn,ja,de,fr,es}` 2.100,
  GPL-2+), one chapter per document; the calibration mix and the evaluation set get different chapters;
- dialogues: the Debian FAQ (`debian-faq`, `-zh-cn`, `-ja`, `-de`, `-fr` 11.1, GPL-2+), each question a user
  turn and its answer an assistant turn, two exchanges per dialogue; stored as messages and rendered through
  each model's own chat template when used;
- source code: modules of the Python standard library (PSF-2.0), different modules on each side;
- English novels: Jane Austen (public domain, already shipped: sensesensibility / emma).

    python calibration_data/build_mix.py --debs /tmp/deb      # downloads the .debs there if absent

A paragraph that appears on both sides is removed from the evaluation side, and a translated paragraph that
is the English text unchanged (left untranslated) is dropped, so that every part is the language it names.
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import os
import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIX_DIR = ROOT / "calibration_data" / "mix-v1"
EVAL_DIR = ROOT / "evals" / "data" / "eval-v1"
REF_VERSION, FAQ_VERSION = "2.100", "11.1"
LANGS = {"en": "en", "zh": "zh-cn", "ja": "ja", "de": "de", "fr": "fr", "es": "es"}
FAQ_LANGS = {"en": "", "zh": "zh-cn", "ja": "ja", "de": "de", "fr": "fr"}
EVAL_CHAPTERS = ("ch02", "ch05", "ch08", "ch11")  # the rest (pr01, ch01.., apa) calibrate
CAL_BYTES, EVAL_BYTES = 150_000, 70_000
CODE_CAL = ("textwrap", "fractions", "heapq", "shlex", "string", "graphlib", "dataclasses", "enum", "bisect",
            "colorsys", "functools", "fnmatch")
CODE_EVAL = ("statistics", "difflib", "calendar")
CJK = re.compile(r"[\u3040-\u30ff\u3400-\u9fff\uff00-\uffef]")
SKIP_TAGS = {"script", "style", "head"}
BLOCK_TAGS = {"p", "pre", "h1", "h2", "h3", "h4", "h5", "dt", "title"}


class Blocks(html.parser.HTMLParser):
    """Text blocks of a DocBook HTML page in order: (tag, text); what sits in <head>, scripts and styles skipped."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.blocks: list[tuple[str, str]] = []
        self.skip = 0
        self.buf: list[str] = []
        self.tag = None

    def handle_starttag(self, tag, attrs):
        if tag in SKIP_TAGS:
            self.skip += 1
        elif tag in BLOCK_TAGS and self.tag is None and not self.skip:
            self.tag, self.buf = tag, []

    def handle_endtag(self, tag):
        if tag in SKIP_TAGS:
            self.skip = max(0, self.skip - 1)
        elif tag == self.tag:
            text = "".join(self.buf)
            text = text if tag == "pre" else join_lines(text)
            if text.strip():
                self.blocks.append((tag, text.strip("\n")))
            self.tag = None

    def handle_data(self, data):
        if not self.skip and self.tag is not None:
            self.buf.append(data)


def page_blocks(path: Path) -> list[tuple[str, str]]:
    """Blocks of one page; the table of contents, navigation and tables removed first."""
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"<div class=\"(toc|navheader|navfooter|list-of-tables|list-of-figures)\">.*?</div>\s*(?=<div|<p|<h)",
                  "", text, flags=re.S)
    text = re.sub(r"<dl class=\"toc\">.*?</dl>\s*</div>", "", text, flags=re.S)
    text = re.sub(r"<table.*?</table>", "", text, flags=re.S)
    parser = Blocks()
    parser.feed(text)
    return parser.blocks


def join_lines(text: str) -> str:
    """A paragraph's wrapped lines joined: no space where both sides are CJK, one space elsewhere."""
    lines = [ln.strip() for ln in text.split("\n") if ln.strip()]
    out = ""
    for ln in lines:
        if out and not (CJK.match(out[-1]) and CJK.match(ln[0])):
            out += " "
        out += ln
    return out


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def paragraphs(blocks) -> list[str]:
    return [t for tag, t in blocks]


def fetch(debs: Path, packages: list[str]) -> dict[str, Path]:
    """Each package's extracted tree under debs/x/<package> (downloaded with apt-get download if absent)."""
    debs.mkdir(parents=True, exist_ok=True)
    trees = {}
    for pkg in packages:
        tree = debs / "x" / pkg
        if not tree.exists():
            files = sorted(debs.glob(f"{pkg}_*.deb"))
            if not files:
                subprocess.run(["apt-get", "download", pkg], cwd=debs, check=True)
                files = sorted(debs.glob(f"{pkg}_*.deb"))
            tree.mkdir(parents=True)
            subprocess.run(["dpkg-deb", "-x", str(files[-1]), str(tree)], check=True)
        trees[pkg] = tree
    return trees


def take(docs: list[tuple[str, list[str]]], limit: int, drop: set[str]) -> tuple[str, list[dict]]:
    """Paragraphs of documents in order until `limit` UTF-8 bytes; (text, documents used with their sha256)."""
    out, used, size = [], [], 0
    for name, paras in docs:
        kept = [p for p in paras if sha(p) not in drop]
        if not kept:
            continue
        body = "\n\n".join(kept)
        used.append({"document": name, "sha256": sha(body), "paragraphs": len(kept)})
        out.append(body)
        size += len(body.encode("utf-8"))
        if size >= limit:
            break
    text = "\n\n".join(out)
    return text[: cut_at(text, limit)], used


def cut_at(text: str, limit: int) -> int:
    """Character index where the text reaches `limit` bytes, moved back to a paragraph end."""
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return len(text)
    head = raw[:limit].decode("utf-8", errors="ignore")
    end = head.rfind("\n\n")
    return end if end > 0 else len(head)


def reference_docs(tree: Path, lang: str, english: set[str]) -> dict[str, list[str]]:
    """Chapter name -> paragraphs (untranslated English ones dropped for other languages)."""
    suffix = LANGS[lang]
    docs = {}
    for page in sorted((tree / "usr/share/debian-reference").glob(f"*.{suffix}.html")):
        chapter = page.name.split(".")[0]
        if chapter == "index":
            continue
        paras = paragraphs(page_blocks(page))
        if lang != "en":
            paras = [p for p in paras if sha(p) not in english or len(p) < 40]
        if lang in ("zh", "ja"):
            paras = [p for p in paras if len(CJK.findall(p)) >= 0.2 * len(p) or len(p) < 40 or p.startswith("$")]
        docs[chapter] = paras
    return docs


def faq_dialogues(tree: Path, lang: str) -> dict[str, list[dict]]:
    """FAQ page -> dialogues: each section's title (its number removed) a question, its paragraphs the answer;
    two consecutive exchanges per dialogue."""
    sub = FAQ_LANGS[lang]
    base = tree / "usr/share/doc/debian/FAQ"
    pages = sorted((base / sub).glob(f"*.{sub}.html")) if sub else sorted(base.glob("*.en.html"))
    out = {}
    for page in pages:
        if page.name.startswith(("index", "faqinfo")):
            continue
        pairs, question, answer = [], None, []
        for tag, text in page_blocks(page):
            if tag in ("h2", "h3"):
                if question and answer:
                    pairs.append((question, answer))
                question, answer = re.sub(r"^[\d.]+\s*", "", text).strip(), []
            elif question is not None and tag in ("p", "pre") and sum(len(a) for a in answer) < 1500:
                answer.append(text)
        if question and answer:
            pairs.append((question, answer))
        dialogues = []
        for i in range(0, len(pairs) - 1, 2):
            messages = []
            for q, a in pairs[i : i + 2]:
                messages += [{"role": "user", "content": q}, {"role": "assistant", "content": "\n\n".join(a)}]
            dialogues.append({"language": lang, "messages": messages})
        out[page.name.split(".")[0]] = dialogues
    return out


def dialogue_text(d: dict) -> str:
    return "\n\n".join(m["content"] for m in d["messages"])


def write_part(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    return path


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


REF_SOURCE = {"version": REF_VERSION, "license": "GPL-2+", "origin": "Debian Reference, Osamu Aoki and translators"}
CODE_SOURCE = {"package": f"Python {sys.version.split()[0]} standard library", "version": sys.version.split()[0],
               "license": "PSF-2.0", "origin": "Python Software Foundation"}
FAQ_SOURCE = {"package": "debian-faq, -zh-cn, -ja, -de, -fr", "version": FAQ_VERSION, "license": "GPL-2+",
              "origin": "The Debian FAQ, Susan G. Kleinmann, Sven Rudolph, Santiago Vila, Josip Rodin, "
                        "Javier Fernandez-Sanguino and translators"}
AUSTEN = {"package": "Project Gutenberg texts of Jane Austen's novels", "version": "-", "license": "public domain",
          "origin": "Jane Austen"}


def manual_parts(trees: dict, cal_parts: list, eval_parts: list, cal_hashes: set) -> None:
    """manual-<lang> on both sides: calibration chapters, then evaluation chapters (paragraphs not calibrated on)."""
    english = {sha(p) for ps in reference_docs(trees["debian-reference-en"], "en", set()).values() for p in ps}
    for lang in LANGS:
        docs = reference_docs(trees[f"debian-reference-{LANGS[lang]}"], lang, english)
        source = {"package": f"debian-reference-{LANGS[lang]}", **REF_SOURCE}
        text, used = take([(n, p) for n, p in docs.items() if n not in EVAL_CHAPTERS], CAL_BYTES, set())
        cal_hashes |= {sha(p) for p in text.split("\n\n")}
        cal_parts.append(("text", f"manual-{lang}", lang, "technical", write_part(MIX_DIR, f"manual-{lang}.txt", text),
                          source, used))
        text, used = take([(n, p) for n, p in docs.items() if n in EVAL_CHAPTERS], EVAL_BYTES, cal_hashes)
        eval_parts.append(("text", f"manual-{lang}", lang, "technical", write_part(EVAL_DIR, f"manual-{lang}.txt", text),
                           source, used))


def code_parts(cal_parts: list, eval_parts: list, cal_hashes: set) -> None:
    """code-python: different standard-library modules on each side."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for side, modules, limit, directory, parts in (("cal", CODE_CAL, CAL_BYTES, MIX_DIR, cal_parts),
                                                   ("eval", CODE_EVAL, EVAL_BYTES, EVAL_DIR, eval_parts)):
        docs = [(f"{m}.py", [(stdlib / f"{m}.py").read_text(encoding="utf-8")]) for m in modules]
        text, used = take(docs, limit, cal_hashes if side == "eval" else set())
        if side == "cal":
            cal_hashes |= {sha(p) for p in text.split("\n\n")}
        parts.append(("text", "code-python", "code", "code", write_part(directory, "code-python.txt", text),
                      CODE_SOURCE, used))


def chosen_dialogues(trees: dict, side: str, limit: int, cal_hashes: set) -> tuple[list[dict], list[dict]]:
    """(dialogues, documents used) of one side: alternate FAQ pages per language, up to limit / languages bytes each."""
    chosen, used, per_lang = [], [], limit // len(FAQ_LANGS)
    for lang in FAQ_LANGS:
        pkg = f"debian-faq{'-' + FAQ_LANGS[lang] if FAQ_LANGS[lang] else ''}"
        pages = faq_dialogues(trees[pkg], lang)
        names = sorted(pages)
        size = 0
        for name in (names[0::2] if side == "cal" else names[1::2]):
            kept = [d for d in pages[name] if side == "cal" or sha(dialogue_text(d)) not in cal_hashes]
            for d in kept:
                d["source"] = f"{pkg}: {name}"
            if not kept:
                continue
            chosen += kept
            used.append({"document": f"{pkg}/{name}",
                         "sha256": sha("\n".join(json.dumps(d, ensure_ascii=False) for d in kept)), "paragraphs": len(kept)})
            size += sum(len(dialogue_text(d).encode("utf-8")) for d in kept)
            if size >= per_lang:
                break
    return chosen, used


def chat_parts(trees: dict, cal_parts: list, eval_parts: list, cal_hashes: set) -> None:
    """chat: FAQ dialogues in five languages, different pages on each side."""
    for side, limit, directory, parts in (("cal", 2 * CAL_BYTES, MIX_DIR, cal_parts),
                                          ("eval", EVAL_BYTES, EVAL_DIR, eval_parts)):
        chosen, used = chosen_dialogues(trees, side, limit, cal_hashes)
        if side == "cal":
            cal_hashes |= {sha(dialogue_text(d)) for d in chosen}
        path = directory / "chat.jsonl"
        path.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in chosen), encoding="utf-8")
        parts.append(("chat", "chat", "multi", "chat", path, FAQ_SOURCE, used))


def build(debs: Path) -> None:
    ref_pkgs = [f"debian-reference-{s}" for s in LANGS.values()]
    faq_pkgs = [f"debian-faq{'-' + s if s else ''}" for s in FAQ_LANGS.values()]
    trees = fetch(debs, ref_pkgs + faq_pkgs)
    MIX_DIR.mkdir(parents=True, exist_ok=True)
    EVAL_DIR.mkdir(parents=True, exist_ok=True)
    cal_parts = [("text", "prose-en", "en", "prose", ROOT / "calibration_data" / "sensesensibility.txt", AUSTEN,
                  [{"document": "Sense and Sensibility"}])]
    eval_parts = [("text", "prose-en", "en", "prose", ROOT / "evals" / "data" / "emma.txt", AUSTEN,
                   [{"document": "Emma"}])]
    cal_hashes: set[str] = set()
    manual_parts(trees, cal_parts, eval_parts, cal_hashes)
    code_parts(cal_parts, eval_parts, cal_hashes)
    chat_parts(trees, cal_parts, eval_parts, cal_hashes)
    write_manifest(MIX_DIR, "mix-v1", "calibration", cal_parts, MIX_WEIGHTS)
    write_manifest(EVAL_DIR, "eval-v1", "evaluation", eval_parts, None)


# the default proportions of calibration windows per part (sum 1); `calibration.mix:` overrides them
MIX_WEIGHTS = {"prose-en": 0.2, "manual-en": 0.08, "manual-zh": 0.1, "manual-ja": 0.08, "manual-de": 0.08,
               "manual-fr": 0.08, "manual-es": 0.08, "code-python": 0.12, "chat": 0.18}


LICENSES = """# Licences of the texts in this directory

See manifest.json for each part's source package, version, licence and sha256.

- manual-*.txt: text of *Debian Reference* (version 2.100, packages debian-reference-en, -zh-cn, -ja, -de, -fr,
  -es), Copyright 2007-2013 Osamu Aoki and the translators, licensed under the GNU General Public License
  version 2 or later (/usr/share/common-licenses/GPL-2 on Debian). Extracted from the HTML chapters
  (calibration_data/build_mix.py); tables and the tables of contents left out.
- chat.jsonl: questions and answers of *The Debian GNU/Linux FAQ* (version 11.1, packages debian-faq, -zh-cn, -ja,
  -de, -fr), Copyright 1996-2021 Susan G. Kleinmann, Sven Rudolph, Santiago Vila, Josip Rodin, Javier
  Fernandez-Sanguino Pena and the translators, licensed under the GNU General Public License version 2 or later.
- code-python.txt: modules of the Python 3.11 standard library, Copyright (c) 2001-2023 Python Software
  Foundation; All Rights Reserved; licensed under the PSF License Agreement (PSF-2.0).
- The Austen novels (../sensesensibility.txt, ../../emma.txt) are in the public domain.
"""


def write_manifest(directory: Path, name: str, role: str, parts: list, weights) -> None:
    entries = []
    for kind, part, lang, domain, path, source, used in parts:
        entry = {"name": part, "kind": kind, "language": lang, "domain": domain,
                 "file": _relative(Path(path), directory),
                 "sha256": file_sha(Path(path)), "bytes": Path(path).stat().st_size, "source": source,
                 "documents": used}
        if weights is not None:
            entry["weight"] = weights[part]
        entries.append(entry)
    manifest = {"name": name, "role": role, "built_by": "calibration_data/build_mix.py", "licenses": "LICENSES.md",
                "parts": entries}
    (directory / "LICENSES.md").write_text(LICENSES, encoding="utf-8")
    (directory / "manifest.json").write_text(json.dumps(manifest, ensure_ascii=False, indent=1) + "\n",
                                             encoding="utf-8")


def _relative(path: Path, directory: Path) -> str:
    return os.path.relpath(path.resolve(), directory.resolve())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--debs", type=Path, default=Path("/tmp/deb"), help="where the .deb files are (or go)")
    build(parser.parse_args().debs)


if __name__ == "__main__":
    main()
