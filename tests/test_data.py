"""data/: real WikiText-2 / WikiText-103 / PTB counts, the completion protocol, sources and
checksums, downloads (file:// URL), and length-bucketed batching."""

import hashlib
import os
import zipfile

import numpy as np
import pytest
import torch

import config
import sample
import train
from common import UserError
from data import prepare as P
from data.loader import batches, bucket, collate, epoch_batches, eval_batches, get_batch, load
from model import LanguageModel

# the counts documented in README.md (section "Data"), produced by data/prepare.py
WT2 = dict(train=(16_560, 2_021_666), valid=(1_777, 211_177), test=(2_006, 237_772))
PTB = dict(train=(36_011, 881_325), valid=(2_863, 69_610), test=(3_165, 77_793))


def test_wikitext2_counts_vocab_and_protocol(wikitext2):
    meta, splits = wikitext2
    assert meta["vocab_size"] == 33_278 and meta["eos_id"] == 0
    for s, (n_seq, n_tok) in WT2.items():
        assert (meta["counts"][s]["sequences"], meta["counts"][s]["tokens"]) == (n_seq, n_tok)
        assert len(splits[s]) == n_seq and splits[s].lengths.sum() == n_tok
        assert meta["counts"][s]["oov_to_unk"] == 0
    tr = splits["train"]
    eos_positions = np.flatnonzero(np.asarray(tr.tokens) == 0)
    np.testing.assert_array_equal(
        eos_positions, tr.offsets[1:] - 1
    )  # eos once, at each sequence's end
    assert tr.lengths.min() >= 12  # > 10 tokens + eos


def test_wikitext2_sequences_are_the_lines(wikitext2):
    """Sequence i is the i-th non-empty train line with > 10 words, word for word."""
    meta, splits = wikitext2
    vocab = meta["vocab"]["tokens"]
    assert len(vocab) == meta["vocab_size"] and "<unk>" in vocab and vocab[0] == "<eos>"
    with P.find_source("wikitext2")["read"]("valid") as f:
        lines = [ln.split() for ln in f if len(ln.split()) > 10]
    va = splits["valid"]
    assert len(lines) == len(va)
    for i in (0, 1, 500, len(va) - 1):
        assert [vocab[j] for j in va[i]] == lines[i] + ["<eos>"]
    assert lines[0][:10] == [vocab[j] for j in va[0][:10]]  # the context x


def test_stream_counts_are_the_usual_corpus_sizes(wikitext2):
    """--task stream: every line + eos, as in the CT / AWD-LSTM setups (PTB 929k train tokens)."""
    for dataset, expected in (
        ("ptb", (929_589, 73_760, 82_430)),
        ("wikitext2", (2_088_628, 217_646, 245_569)),
    ):
        meta, splits, streams = load(dataset, verbose=False)
        assert tuple(len(streams[s]) for s in ("train", "valid", "test")) == expected
        assert (
            tuple(meta["counts"][s]["stream_tokens"] for s in ("train", "valid", "test"))
            == expected
        )


def test_ptb_counts(capsys, monkeypatch):
    meta, splits, _ = load("ptb", verbose=False)
    assert meta["vocab_size"] == 10_000
    for s, (n_seq, n_tok) in PTB.items():
        assert (len(splits[s]), int(splits[s].lengths.sum())) == (n_seq, n_tok)
    P.main(["--dataset", "ptb"])  # prepared already: the counts are printed anyway
    assert f"{PTB['train'][0]:,}" in capsys.readouterr().err
    # prepared once, the official files are not read again without a data folder (offline, or
    # trained from a local copy): no download (it fetched them, or failed offline)
    monkeypatch.delenv("NANOGEN_DATA", raising=False)
    monkeypatch.setattr(P, "fetch", lambda *a: pytest.fail("the raw files were fetched again"))
    folder = P.prepare("ptb", verbose=False)
    assert np.array_equal(
        np.fromfile(os.path.join(folder, "train.idx"), dtype=np.int64), splits["train"].offsets
    )


@pytest.mark.slow
def test_wikitext103_bpe(tmp_path):
    meta, splits, _ = load("wikitext103", verbose=False)
    assert meta["tokenizer"] == "gpt2" and meta["eos_id"] == 50256 and meta["vocab_size"] == 50257
    enc, src = P.BPE().enc, P.find_source("wikitext103")
    with src["read"]("valid") as f:
        first = next(ln for ln in f if len(enc.encode_ordinary(ln.strip())) > 10)
    va = splits["valid"]
    assert enc.decode(list(va[0][:-1])) == first.strip() and va[0][-1] == 50256
    assert va.lengths.max() <= 1024 and va.lengths.min() >= 12
    assert meta["counts"]["valid"]["sequences"] == len(va)
    assert meta["source"] == src["sha256"]  # (the shared subset: its own checksum is recorded)


def _zip(path, members):
    with zipfile.ZipFile(path, "w") as z:
        for name, text in members.items():
            z.writestr(name, text)


LINE = " ".join(f"w{i}" for i in range(14)) + " \n"


def test_checksum_mismatch_clear_error_no_partial_files(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "data"
    bad.mkdir()
    _zip(bad / "wikitext-2-v1.zip", {f"wikitext-2/wiki.{s}.tokens": LINE for s in P.SPLITS})
    with pytest.raises(UserError, match="checksum mismatch.*wikitext-2-v1.zip"):
        P.prepare("wikitext2", str(bad), verbose=False)
    prepared = tmp_path / "cache" / "prepared"
    assert not prepared.exists() or not any(prepared.iterdir())


def test_local_folder_and_unofficial_zip_accepted(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "extracted"
    (d / "wikitext-2").mkdir(parents=True)
    for s in P.SPLITS:
        (d / "wikitext-2" / f"wiki.{s}.tokens").write_text(" \n" + LINE + " short line \n" + LINE)
    folder = P.prepare("wikitext2", str(d), verbose=False)
    meta = P.load_meta(folder)
    assert not P.find_source("wikitext2", str(d))["official"]
    assert meta["counts"]["train"] == dict(
        lines=4,
        empty=1,
        dropped_short=1,
        dropped_long=0,
        sequences=2,
        tokens=30,
        stream_tokens=34,
        oov_to_unk=0,
    )
    z = tmp_path / "z"
    z.mkdir()
    _zip(z / "my-copy.zip", {f"wikitext-2/wiki.{s}.tokens": LINE for s in P.SPLITS})
    src = P.find_source("wikitext2", str(z))
    assert src["path"] == str(z / "my-copy.zip") and not src["official"]
    assert src["sha256"] == P.sha256_file(z / "my-copy.zip")
    P.prepare("wikitext2", str(z), verbose=True)
    err = capsys.readouterr().err
    assert f"note: {z / 'my-copy.zip'} is a copy of wikitext2 other than the official files" in err


def test_download_from_file_url_verifies_sha256(tmp_path):
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(3_000_000))
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    dest = tmp_path / "dl" / "out.bin"
    P.download(src.as_uri(), str(dest), sha)
    assert dest.read_bytes() == src.read_bytes()
    dest2 = tmp_path / "dl" / "bad.bin"
    with pytest.raises(UserError, match="checksum mismatch"):
        P.download(src.as_uri(), str(dest2), "0" * 64)
    assert sorted(os.listdir(tmp_path / "dl")) == ["out.bin"]  # no partial file left


def test_download_unreachable_and_offline_messages(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("NANOGEN_DATA", raising=False)
    with pytest.raises(UserError, match="could not download.*--data_dir"):
        P.download("http://127.0.0.1:9/wikitext-2-v1.zip", str(tmp_path / "x.zip"), "0" * 64)
    monkeypatch.setenv("NANOGEN_OFFLINE", "1")
    with pytest.raises(UserError, match="NANOGEN_OFFLINE.*--data_dir"):
        P.prepare("wikitext2", verbose=False)


def test_unknown_dataset(capsys):
    with pytest.raises(SystemExit):
        P.main(["--dataset", "imagenet"])
    assert "invalid choice: 'imagenet'" in capsys.readouterr().err


def test_batches_cover_everything_once_and_respect_limits():
    rng = np.random.default_rng(0)
    lengths = rng.integers(12, 300, size=1000)
    for kw in (dict(batch_size=32), dict(max_tokens=1024)):
        bs = batches(lengths, **kw, rng=np.random.default_rng([3, 1]))
        flat = np.concatenate(bs)
        assert sorted(flat.tolist()) == list(range(1000))
        for b in bs:
            if "batch_size" in kw:
                assert len(b) <= 32
            else:
                assert len(b) == 1 or len(b) * (lengths[b].max() - 1) <= 1024
        again = batches(lengths, **kw, rng=np.random.default_rng([3, 1]))
        assert all((a == b).all() for a, b in zip(bs, again))  # a pure function of (seed, epoch)
        other = batches(lengths, **kw, rng=np.random.default_rng([3, 2]))
        assert any(len(a) != len(b) or (a != b).any() for a, b in zip(bs, other))
    sorted_bs = batches(lengths, batch_size=50)
    spans = [(lengths[b].min(), lengths[b].max()) for b in sorted_bs]
    assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1))  # bucketed by length
    assert np.concatenate(batches(lengths, batch_size=7, max_len=100)).size == int(
        (lengths - 1 <= 100).sum()
    )


@pytest.mark.slow  # (every batch of a WikiText-2 epoch)
def test_max_tokens_batches_come_in_few_shapes_with_little_padding():
    """The GPT recipe's 1024-token batches on WikiText-103 (a compiled step keeps one graph a
    shape): an epoch's batches come in <= 32 (B, T) shapes, T rounded up to its bucket, and the
    padding is <= 10 % of the batches' tokens (before buckets: 349 shapes in this epoch)."""
    args = train.argparse.Namespace(
        **dict(
            config.DEFAULTS,
            task="completion",
            max_tokens=1024,
            window=1024,
            batch_size=None,
            train_seqs=0,
        )
    )
    _, splits, _ = load("wikitext103", verbose=False)
    data = dict(splits)
    for split in ("train", "valid"):
        keys = eval_batches(args, data, split)
        if split == "train":
            keys = epoch_batches(args, data, 0)
        shapes = [tuple(get_batch(args, data, k, "cpu", split)["inputs"].shape) for k in keys]
        real = int(sum(data[split].lengths[k].sum() - len(k) for k in keys))
        assert sorted(np.concatenate(keys).tolist()) == list(range(len(data[split])))
        assert len(set(shapes)) <= 32 and all(B * T <= 1024 for B, T in shapes), set(shapes)
        assert {T for _, T in shapes} <= set(bucket(np.arange(1, 1025)).tolist())
        assert 1 - real / sum(B * T for B, T in shapes) <= 0.10
    assert bucket(np.array([1, 8, 9, 33, 64, 65, 100, 129, 513, 1000, 1025])).tolist() == [
        8,
        8,
        16,
        40,
        64,
        80,
        112,
        160,
        640,
        1024,
        1280,
    ]  # a quarter octave: <= 25 % padding
    assert bucket(1000, cap=1000) == 1000  # never past the window


def test_a_bucket_s_padding_changes_no_number(wikitext2):
    """A batch padded up to its bucket scores its sequences as padded to their longest (float64)."""
    _, splits = wikitext2
    torch.manual_seed(0)
    lm = LanguageModel(
        dict(
            model="gpt",
            head="nmst",
            epsilon=1e-3,
            vocab_size=33278,
            eos_id=0,
            n_layer=1,
            d_model=16,
            n_head=2,
            block_size=512,
            dropout=0.0,
            tie=True,
            bias=True,
        )
    ).double()
    index = [3, 10, 57]
    tight, wide = collate(splits["valid"], index), collate(splits["valid"], index, cap=512)
    assert wide["inputs"].shape[1] == bucket(tight["inputs"].shape[1]) > tight["inputs"].shape[1]
    assert (wide["n"], wide["n_inputs"]) == (tight["n"], tight["n_inputs"])
    a, ma, _ = lm(tight)
    b, mb, _ = lm(wide)
    torch.testing.assert_close(a[ma], b[mb], rtol=0, atol=1e-12)


def test_collate_and_loss_mask_select_the_continuation():
    class Split:
        seqs = [np.arange(1, 13), np.arange(1, 16), np.arange(1, 17)]
        contexts = np.array([10, 10, 13])  # the third: a char-level-like longer context

        def __getitem__(self, i):
            return self.seqs[i]

    b = collate(Split(), [0, 1, 2])
    assert b["tokens"].shape == (3, 16) and b["lengths"].tolist() == [12, 15, 16]
    m, t = b["mask"], b["t"]
    targets = b["targets"]
    assert torch.equal(targets, b["tokens"][:, 1:]) and torch.equal(
        b["inputs"], b["tokens"][:, :-1]
    )
    assert targets[0][m[0]].tolist() == [11, 12] and targets[1][m[1]].tolist() == [
        11,
        12,
        13,
        14,
        15,
    ]
    assert targets[2][m[2]].tolist() == [14, 15, 16]
    assert t[1][m[1]].tolist() == [1, 2, 3, 4, 5]  # t = 1 at the first continuation token
    assert (
        t[1, :9].tolist() == list(range(-8, 1)) and t[0, 11:].tolist() == [0] * 4
    )  # context, padding


@pytest.mark.parametrize("kind", ["word", "char"])
def test_a_prompt_of_ten_words_is_encoded_as_a_training_context(kind):
    """sample.py's prompt and the protocol's context of the same words are the same ids (char
    level: the words and the space after them), so t = 1 falls on the same token."""
    line = "the cat sat on the mat and then it ran far away"  # 12 words: 10 context + 2
    tok = P.Vocabulary.build(kind, [line])
    ids, ctx = next(tok.encode([line]))
    assert sample.encode_prompt(tok, " ".join(line.split()[:10])) == ids[:ctx]


@pytest.mark.slow
@pytest.mark.parametrize("dataset", ["ptb", "wikitext2"])
def test_char_vocabulary_round_trip_and_protocol(dataset):
    """--vocab char (the survey's section 2.1): decode(encode(text)) == text for every line of
    the split, the same sequences as at word level (lines of > 10 words), eos at the end, and a
    context of the first 10 words and the space after them."""
    meta, splits, _ = load(dataset, vocab="char", verbose=False)
    word_meta = load(dataset, verbose=False)[0]
    tok = P.tokenizer(meta["vocab"])
    assert (
        meta["tokenizer"] == "char"
        and meta["vocab_size"] < 300
        and tok.tokens[:2] == ["<eos>", "<unk>"]
    )
    with P.find_source(dataset)["read"]("valid") as f:
        lines = [ln for ln in f if ln.strip()]
    for line in lines:
        ids, ctx = next(tok.encode([line]))
        assert tok.decode(ids) == " ".join(line.split())
    long = [ln for ln in lines if len(ln.split()) > 10]
    va = splits["valid"]
    assert len(va) == len(long) == word_meta["counts"]["valid"]["sequences"]
    for i in (0, 1, len(va) - 1):
        words = long[i].split()
        assert tok.decode(va[i][:-1].tolist()) == " ".join(words) and va[i][-1] == 0
        assert tok.decode(va.context(i).tolist()) == " ".join(words[:10]) + " "
    assert meta["counts"]["valid"]["oov_to_unk"] == 0  # every valid character is seen in train


def test_a_preparation_finished_meanwhile_by_another_process_is_kept(tmp_path, monkeypatch):
    """Two commands preparing the same data at once: the first to finish wins; the second drops
    its own copy rather than delete the folder the first may be reading."""
    monkeypatch.setenv("NANOGEN_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "extracted"
    (d / "wikitext-2").mkdir(parents=True)
    for s in P.SPLITS:
        (d / "wikitext-2" / f"wiki.{s}.tokens").write_text(LINE + "\n" + LINE)
    build, theirs = P.build, {}

    def build_while_another_finishes(*a):
        meta = build(*a)
        monkeypatch.setattr(P, "build", build)
        theirs["folder"] = P.prepare("wikitext2", str(d), verbose=False)  # the other process
        theirs["inode"] = os.stat(os.path.join(theirs["folder"], "meta.json")).st_ino
        return meta

    monkeypatch.setattr(P, "build", build_while_another_finishes)
    folder = P.prepare("wikitext2", str(d), verbose=False)
    assert (
        folder == theirs["folder"]
        and os.stat(os.path.join(folder, "meta.json")).st_ino == theirs["inode"]
    )
    assert sorted(os.listdir(os.path.dirname(folder))) == [
        os.path.basename(folder)
    ]  # no temporary left
