"""Training data: records, chat rendering with assistant-only masks, packing, and the offline corpus split."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from swiftkv_core import data as D


@pytest.fixture(scope="module")
def tok(tiny_base):
    return AutoTokenizer.from_pretrained(tiny_base)


def test_records_from_txt_jsonl_and_folder(tmp_path):
    (tmp_path / "a.txt").write_text("plain text")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "t"}) + "\n\n" + json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert D.load_records(tmp_path / "a.txt") == [{"text": "plain text"}]
    assert len(D.load_records(tmp_path / "b.jsonl")) == 2
    assert len(D.load_records(tmp_path)) == 3
    separators = {"text": "one\u2028two\u2029three\x85four"}  # JSON leaves them unescaped; they end no line
    (tmp_path / "sep.jsonl").write_text(json.dumps(separators, ensure_ascii=False) + "\r\n", encoding="utf-8")
    assert D.load_records(tmp_path / "sep.jsonl") == [separators]
    with pytest.raises(D.DataError, match="does not exist"):
        D.load_records(tmp_path / "nope.txt")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(D.DataError, match="bad.jsonl:2"):
        D.load_records(tmp_path / "bad.jsonl")
    (tmp_path / "deep.jsonl").write_text('{"text": "ok"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(D.DataError, match="deep.jsonl:2: nested too deeply"):
        D.load_records(tmp_path / "deep.jsonl")
    (tmp_path / "wrong.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(D.DataError, match="'text' or 'messages'"):
        D.load_records(tmp_path / "wrong.jsonl")


def test_chat_assistant_only_mask_covers_exactly_the_answers(tok):
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome."},
    ]
    ids, targets = D.encode_chat(messages, tok, assistant_only=True)
    assert len(ids) == len(targets)
    masked = tok.decode([i for i, t in zip(ids, targets) if t])
    assert masked == "The capital of France is Paris.<|im_end|>Rome.<|im_end|>"
    ids_all, targets_all = D.encode_chat(messages, tok, assistant_only=False)
    assert ids_all == ids and all(targets_all)


def test_packing_and_loss_mask(tok):
    records = [{"text": "The quick brown fox jumps over the lazy dog. " * 10},
               {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]}]
    ids, targets = D.encode_records(records, tok)
    assert ids.count(D.separator_id(tok)) >= 2
    packed = D.pack(ids, targets, 16)
    assert packed.ids.shape == (len(ids) // 16, 16) and packed.target.dtype == torch.bool
    mask = D.loss_mask(packed.target)
    assert torch.equal(mask[:, :-1], packed.target[:, 1:]) and not mask[:, -1].any()
    with pytest.raises(D.DataError, match="not enough text"):
        D.pack(ids[:10], targets[:10], 16)


def test_assistant_only_data_without_assistant_messages_is_an_error(tok, tmp_path):
    path = tmp_path / "users.jsonl"
    path.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": "question number %d is here" % i}]}) for i in range(50)))
    with pytest.raises(D.DataError, match="no target tokens"):
        D.load_packed(path, tok, 16)
    assert len(D.load_packed(path, tok, 16, assistant_only=False)) > 0


def test_passages_split_and_heldout_are_deterministic():
    text = "\n\n".join(f"paragraph {i} " + "x" * 300 for i in range(20))
    ps = D.passages(text, max_chars=1000)
    assert all(len(p) <= 1000 for p in ps) and "".join(ps).count("paragraph") == 20
    ids = [f"file{i}.rst" for i in range(1000)]
    held = [i for i in ids if D.is_heldout(i, 10)]
    assert 50 < len(held) < 150 and held == [i for i in ids if D.is_heldout(i, 10)]


@pytest.mark.skipif(not (D.PYTHON_DOC_DIR.is_dir() and D.LINUX_DOC_DIR.is_dir()), reason="Debian doc packages not installed")
@pytest.mark.slow
def test_prepare_corpus_keeps_heldout_files_out_of_training(tmp_path):
    manifest = D.prepare_corpus(tmp_path, train_chars_per_source=30_000, heldout_chars_per_source=5_000, cache_dir=tmp_path / "src",
                                manpages=12)
    train = D.load_records(tmp_path / "train.jsonl")
    held = D.load_records(tmp_path / "heldout.jsonl")
    assert train and held
    assert {r["source"] for r in train} == {"shakespeare", "python-docs", "linux-docs"}
    assert any("messages" in r for r in train) and any("text" in r for r in train)
    def body(r):
        return r.get("text") or r["messages"][1]["content"]
    assert not {body(r) for r in train} & {body(r) for r in held}
    assert manifest["stats"]["python-docs"]["train"]["chars"] >= 30_000
    # The second held-out set: man pages, a kind of text no training record comes from.
    pages = D.load_records(tmp_path / D.MANPAGES_FILE)
    assert len(pages) == manifest["stats"]["manpages"]["heldout"]["pages"] == 12
    assert {r["source"] for r in pages} == {"manpages"} and not {body(r) for r in train} & {r["text"] for r in pages}
    assert "heldout_manpages" in manifest["sha256"]
    # Training-only sources leave both held-out sets as they were and add only training text.
    more = D.prepare_corpus(tmp_path / "more", train_chars_per_source=30_000, heldout_chars_per_source=5_000, cache_dir=tmp_path / "src",
                            manpages=12, extra_sources=("python-source",))
    assert more["sha256"]["heldout"] == manifest["sha256"]["heldout"]
    assert more["sha256"]["heldout_manpages"] == manifest["sha256"]["heldout_manpages"]
    more_train = D.load_records(tmp_path / "more" / "train.jsonl")
    assert sorted(map(body, more_train)) == sorted([body(r) for r in train] + [r["text"] for r in more_train if r["source"] == "python-source"])
    assert more["stats"]["python-source"]["train"]["chars"] >= 30_000 and "python-source" in more["sources"]


def test_extra_sources_read_package_docs_and_library_code_but_not_the_corpora_or_tests(tmp_path):
    import gzip as gz

    docs, lib = tmp_path / "doc", tmp_path / "lib"
    files = {docs / "frob" / "README": b"Frob turns widgets into gadgets.", docs / "frob" / "changelog.Debian.gz": gz.compress(b"frob (1.0) stable"),
             docs / "frob" / "copyright": b"not documentation", docs / "python3.11" / "notes.txt": b"a corpus of its own",
             docs / "linux-doc-6.1" / "README": b"a corpus of its own", lib / "json" / "__init__.py": b'"""JSON encoder."""',
             lib / "test" / "test_json.py": b"tests stay out", lib / "site-packages" / "x.py": b"not the library"}
    for path, raw in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(raw)
    got = D.extra_corpus_files(("system-docs", "python-source"), doc_dir=docs, python_dir=lib)
    assert got["system-docs"] == [("frob/README", "Frob turns widgets into gadgets."), ("frob/changelog.Debian.gz", "frob (1.0) stable")]
    assert got["python-source"] == [("json/__init__.py", '"""JSON encoder."""')]
    with pytest.raises(D.DataError, match="unknown extra source.*manpages.*choose from system-docs, python-source"):
        D.extra_corpus_files(("manpages",))
    with pytest.raises(D.DataError, match="no files found for extra source python-source"):
        D.extra_corpus_files(("python-source",), python_dir=tmp_path / "empty")


PAGE = r""".\" A hand-written page in man(7) source.
.TH FROB 1 "May 2024" "frob 1.0" "User Commands"
.SH NAME
frob \- turn widgets into \fBgadgets\fR
.SH SYNOPSIS
.B frob
[\fI\,OPTION\/\fR]... \fIFILE\fR
.SH DESCRIPTION
.PP
Frob reads each \fIFILE\fR and writes \(lqgadgets\(rq to standard output.
.TP
\fB\-q\fR, \fB\-\-quiet\fR
print nothing
.BR gizmo (1)
"""


def test_roff_stripper_without_groff():
    assert D._strip_roff(PAGE).strip() == (
        "NAME\nfrob - turn widgets into gadgets\n\nSYNOPSIS\nfrob\n[OPTION]... FILE\n\nDESCRIPTION\n\n"
        'Frob reads each FILE and writes "gadgets" to standard output.\n\n-q, --quiet\nprint nothing\ngizmo(1)')


@pytest.mark.skipif(not __import__("shutil").which("groff"), reason="groff not installed")
def test_groff_renders_a_page_to_plain_text(tmp_path):
    import gzip

    (tmp_path / "frob.1.gz").write_bytes(gzip.compress(PAGE.encode()))
    text = D.render_manpage(tmp_path / "frob.1.gz")
    assert "frob - turn widgets into gadgets" in text and "FROB(1)" not in text  # no page header or footer
    assert "Frob reads each FILE and writes" in text and "\x1b" not in text and "\b" not in text and "\\f" not in text


def test_manpages_choice_is_deterministic_and_diverse(tmp_path):
    import gzip

    man1 = tmp_path / "man1"
    man1.mkdir()
    body = "\n".join(f".PP\nParagraph {i} of the frob family's page about widgets and gadgets." for i in range(40))
    for name in ("frob", "frob-a", "frob-b", "frob-c", "zap", "zip", "tool_x"):
        (man1 / f"{name}.1.gz").write_bytes(gzip.compress(PAGE.replace("frob", name).encode() + body.encode()))
    (man1 / "zap2.1.gz").write_bytes(gzip.compress(PAGE.replace("frob", "zap").encode() + body.encode()))  # duplicate text
    (man1 / "short.1.gz").write_bytes(gzip.compress(b".so man1/zap.1\n"))  # a redirect: too short
    (man1 / "alias.1.gz").symlink_to(man1 / "zip.1.gz")
    stats = D.prepare_manpages(tmp_path / "a.jsonl", man_dirs=(man1,))
    D.prepare_manpages(tmp_path / "b.jsonl", man_dirs=(man1,))
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    recs = D.load_records(tmp_path / "a.jsonl")
    assert stats["pages"] == len(recs) == 5  # frob: 2 of 4 pages; zap, zip, tool_x; no duplicate, redirect or symlink
    assert {r["source"] for r in recs} == {"manpages"} and all(len(r["text"]) >= 1500 for r in recs)
    assert sum("frob" in r["text"].split("\n")[1] for r in recs) == 2
    assert len(D.load_records(tmp_path / "a.jsonl")) == 5
    assert D.prepare_manpages(tmp_path / "c.jsonl", pages=2, man_dirs=(man1,))["pages"] == 2
    with pytest.raises(D.DataError, match="no man pages"):
        D.prepare_manpages(tmp_path / "d.jsonl", man_dirs=(tmp_path / "nowhere",))
