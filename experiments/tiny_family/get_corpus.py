#!/usr/bin/env python3
"""Build the tiny-family text corpus offline from Debian packages.

Sources (fetched with ``apt-get download`` and unpacked with ``dpkg -x`` into a
temporary directory -- nothing is installed into /):

* ``bible-kjv-text`` + ``bible-kjv`` -- the King James Version (public domain
  outside the UK).  The package stores the text in a private compressed format,
  so the package's own ``bible`` binary (run from the temp dir, ``-p`` pointing
  at the unpacked data file) dumps ``gen1:1-rev22:21`` as plain text.
  One document = one chapter: a title line ("Genesis 1") then one verse per
  line, verse numbers removed.  1189 documents.
* ``wordnet-base`` -- WordNet 3.0 (Princeton "WordNet 3.0 license": free use
  with the copyright notice, see models/tiny/MODEL_CARD.md).  From each
  ``data.{noun,verb,adj,adv}`` synset line we keep the lemmas and the gloss:
  ``"lemma1, lemma2: gloss; "example""`` (underscores -> spaces, adjective
  markers like ``(a)`` dropped).  Consecutive synsets of one file (file order =
  lexicographer order, so neighbours are related) are grouped into documents
  of >= 1200 characters (so ~1.2-1.5K chars each).
* ``dict-gcide`` is NOT used: GCIDE is GPL-licensed, not public domain, and the
  held-out split is committed to the repository.

Split (deterministic, independent of document order):
``h = int(sha256("kvt-tiny-split:" + doc_id)[:8], 16) % 1000``;
``h < 60`` -> heldout (~6 %), otherwise train.  Held-out documents are further
split by ``sha256("kvt-tiny-calib:" + doc_id)`` parity: even -> calib, odd ->
eval (calibration and evaluation never share a document).

Outputs (JSON lines ``{"id": ..., "source": ..., "text": ...}`` for train;
``{"text": ...}`` for the committed held-out files, as specified):
  <workdir>/train.jsonl           (not committed, ~13 MB)
  data/tiny/heldout.jsonl         (all held-out documents)
  data/tiny/calib.jsonl, data/tiny/eval.jsonl  (disjoint halves of heldout)

Usage:  python experiments/tiny_family/get_corpus.py --workdir /tmp/kvt_tiny
"""
import argparse
import hashlib
import json
import os
import re
import subprocess
import tempfile

PACKAGES = ["bible-kjv-text", "bible-kjv", "wordnet-base"]
HELDOUT_PER_MILLE = 60
WN_DOC_CHARS = 1200


def _hash(s):
    return int(hashlib.sha256(s.encode()).hexdigest()[:8], 16)


def fetch(tmp):
    """apt-get download the packages and dpkg -x them into tmp/root."""
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(["apt-get", "download", *PACKAGES], cwd=tmp, check=True)
    root = os.path.join(tmp, "root")
    for f in sorted(os.listdir(tmp)):
        if f.endswith(".deb"):
            subprocess.run(["dpkg", "-x", os.path.join(tmp, f), root], check=True)
    return root


def kjv_docs(root):
    """Dump the KJV with the package's own binary; one document per chapter."""
    out = subprocess.run(
        [os.path.join(root, "usr/bin/bible"), "-l100000", "-p", os.path.join(root, "usr/lib"),
         "gen1:1-rev22:21"],
        check=True, capture_output=True, text=True, env={**os.environ, "COLUMNS": "100000"},
    ).stdout
    docs, title, verses = [], None, []
    for line in out.splitlines():
        m = re.match(r"^\s+\d+ (.*)$", line)
        if m:
            verses.append(m.group(1).strip())
        elif line.strip():
            if title is not None:
                docs.append((f"kjv:{title}", "kjv", title + "\n" + "\n".join(verses)))
            title, verses = line.strip(), []
    docs.append((f"kjv:{title}", "kjv", title + "\n" + "\n".join(verses)))
    return docs


def wordnet_docs(root):
    docs = []
    for pos in ["noun", "verb", "adj", "adv"]:
        path = os.path.join(root, "usr/share/wordnet", f"data.{pos}")
        buf, first = [], None
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("  ") or "|" not in line:
                    continue  # licence header
                head, gloss = line.split("|", 1)
                fields = head.split()
                n = int(fields[3], 16)
                lemmas = [re.sub(r"\(.*\)$", "", w).replace("_", " ") for w in fields[4:4 + 2 * n:2]]
                entry = ", ".join(dict.fromkeys(lemmas)) + ": " + gloss.strip()
                if first is None:
                    first = fields[0]
                buf.append(entry)
                if sum(len(e) + 1 for e in buf) >= WN_DOC_CHARS:
                    docs.append((f"wn:{pos}:{first}", "wordnet", "\n".join(buf)))
                    buf, first = [], None
        if buf:
            docs.append((f"wn:{pos}:{first}", "wordnet", "\n".join(buf)))
    return docs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workdir", default="/tmp/kvt_tiny", help="where train.jsonl goes (not committed)")
    ap.add_argument("--datadir", default="data/tiny", help="where the held-out files go (committed)")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    os.makedirs(args.datadir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = fetch(tmp)
        docs = kjv_docs(root) + wordnet_docs(root)
    assert len({d[0] for d in docs}) == len(docs), "document ids must be unique"
    train, held = [], []
    for doc in docs:
        (held if _hash("kvt-tiny-split:" + doc[0]) % 1000 < HELDOUT_PER_MILLE else train).append(doc)
    with open(os.path.join(args.workdir, "train.jsonl"), "w") as f:
        for i, s, t in train:
            f.write(json.dumps({"id": i, "source": s, "text": t}) + "\n")
    outs = {k: open(os.path.join(args.datadir, f"{k}.jsonl"), "w") for k in ["heldout", "calib", "eval"]}
    for i, s, t in held:
        line = json.dumps({"text": t}) + "\n"
        outs["heldout"].write(line)
        outs["calib" if _hash("kvt-tiny-calib:" + i) % 2 == 0 else "eval"].write(line)
    for f in outs.values():
        f.close()
    n_chars = lambda ds: sum(len(d[2]) for d in ds)  # noqa: E731
    for src in ["kjv", "wordnet"]:
        tr = [d for d in train if d[1] == src]
        he = [d for d in held if d[1] == src]
        print(f"{src}: train {len(tr)} docs / {n_chars(tr)} chars; heldout {len(he)} docs / {n_chars(he)} chars")


if __name__ == "__main__":
    main()
