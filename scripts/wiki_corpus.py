"""Extract an English prose corpus (Wikipedia articles and ABC news stories) from gensim's wheel.

gensim 4.3.3 ships, as test data, the start of a 2016 English Wikipedia dump (about 200 articles,
CC BY-SA) and the Lee corpus (300 ABC news stories). Both are real encyclopedia and news prose,
which verispec's templated training prompts lack. Writes two JSON-lines files of
{"source", "title", "text"} documents: OUT/train.jsonl and OUT/heldout.jsonl (one document in ten,
never trained on, for choosing settings).

    pip download gensim==4.3.3 --no-deps -d runs/
    python scripts/wiki_corpus.py runs/gensim-4.3.3-*.whl runs/corpus
"""

from __future__ import annotations

import argparse
import bz2
import html
import json
import random
import re
import zipfile
from pathlib import Path

DATA = "gensim/test/test_data/"
WIKI = DATA + "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
NEWS = DATA + "lee_background.cor"
# Sections after which an article is lists of links and sources, not prose.
TAIL = re.compile(r"^==+\s*(See also|References|Notes|External links|Further reading|Bibliography|"
                  r"Sources|Footnotes|Citations)\s*==+", re.M)


def _drop_nested(text: str, open_: str, close: str) -> str:
    """Remove every (possibly nested) open_ ... close span."""
    out, depth, i = [], 0, 0
    while i < len(text):
        if text.startswith(open_, i):
            depth, i = depth + 1, i + len(open_)
        elif depth and text.startswith(close, i):
            depth, i = depth - 1, i + len(close)
        else:
            if not depth:
                out.append(text[i])
            i += 1
    return "".join(out)


def clean_wikitext(text: str) -> str:
    """Plain prose paragraphs from an article's wikitext."""
    text = html.unescape(html.unescape(text))  # the dump escapes entities twice (&amp;nbsp;)
    match = TAIL.search(text)
    text = text[: match.start()] if match else text
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"<ref[^>/]*/>", "", text)
    text = re.sub(r"<ref[^>]*>.*?</ref>", "", text, flags=re.S)
    text = _drop_nested(text, "{{", "}}")
    text = _drop_nested(text, "{|", "|}")
    text = re.sub(r"\[\[(?:File|Image|Category|[a-z\-]{2,12}):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]",
                  "", text)
    text = re.sub(r"\[\[([^\]|]*)\|([^\]]*)\]\]", r"\2", text)
    text = re.sub(r"\[\[([^\]]*)\]\]", r"\1", text)
    text = re.sub(r"\[https?://\S+ ([^\]]*)\]", r"\1", text)
    text = re.sub(r"\[https?://\S+\]", "", text)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"<[^>]+>", "", text)
    # Parentheses the template removal emptied: "()" and "(; )" go, "(; 22 February" -> "(22 February".
    text = re.sub(r"\((?:[;,]\s*)*\)\s?", "", text)
    text = re.sub(r"\(\s*[;,]\s*", "(", text)
    paragraphs = []
    for para in text.split("\n"):
        para = para.strip()
        heading = re.fullmatch(r"=+\s*(.*?)\s*=+", para)
        if heading:
            para = heading.group(1)
        elif para.startswith(("*", "#", ":", ";", "|", "!")) or len(para) < 40:
            continue
        paragraphs.append(" ".join(para.split()))
    # A heading is kept only when prose follows it.
    kept = [p for i, p in enumerate(paragraphs)
            if len(p) >= 40 or (i + 1 < len(paragraphs) and len(paragraphs[i + 1]) >= 40)]
    return "\n\n".join(kept)


def wiki_articles(wheel: zipfile.ZipFile) -> list[dict]:
    xml = bz2.decompress(wheel.read(WIKI)).decode("utf-8")
    docs = []
    for page in re.findall(r"<page>(.*?)</page>", xml, flags=re.S):
        title = re.search(r"<title>(.*?)</title>", page).group(1)
        body = re.search(r"<text[^>]*>(.*?)</text>", page, flags=re.S)
        if body is None or body.group(1).lstrip().upper().startswith("#REDIRECT"):
            continue
        text = clean_wikitext(body.group(1))
        if len(text) >= 1000:
            docs.append({"source": "wikipedia", "title": html.unescape(title), "text": text})
    return docs


def news_stories(wheel: zipfile.ZipFile) -> list[dict]:
    lines = wheel.read(NEWS).decode("utf-8", errors="replace").splitlines()
    return [{"source": "abc-news", "title": "", "text": " ".join(line.split())}
            for line in lines if len(line) >= 300]


def main(wheel_path: str, out_dir: str) -> None:
    with zipfile.ZipFile(wheel_path) as wheel:
        docs = wiki_articles(wheel) + news_stories(wheel)
    random.Random(0).shuffle(docs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    held, train = docs[::10], [d for i, d in enumerate(docs) if i % 10]
    for name, part in (("train", train), ("heldout", held)):
        with open(out / f"{name}.jsonl", "w") as f:
            for d in part:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")
        chars = sum(len(d["text"]) for d in part)
        print(f"{name}: {len(part)} documents, {chars / 1e6:.2f} M characters")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheel", help="gensim 4.3.3's wheel, downloaded with pip download")
    parser.add_argument("out_dir", help="where train.jsonl and heldout.jsonl go")
    args = parser.parse_args()
    main(args.wheel, args.out_dir)
