"""Training with the project's own code: corpus reading, tokenizer, a few steps of a tiny recipe, exact resume,
the 8-device data/expert-parallel step against the 1-device step, release, evaluation windows, bad input."""

import dataclasses
import json
import os
import struct
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ernie_jax.config import ErnieConfig
from ernie_jax.train import corpus as corpus_mod
from ernie_jax.train import recipes
from ernie_jax.train.data import batch_at, chat_turns
from ernie_jax.train.evaluate import rolling_windows
from ernie_jax.train.rdata import RDataError, read_lazyload
from ernie_jax.train.run import RunError, load_trained, train
from ernie_jax.train.step import init_params, init_state, train_step

EN = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
      "want of a wife. However little known the feelings or views of such a man may be on his first entering a "
      "neighbourhood, this truth is so well fixed in the minds of the surrounding families.")
ZH = "滚滚长江东逝水，浪花淘尽英雄。是非成败转头空。青山依旧在，几度夕阳红。"


def write_corpus(folder, n_docs=12):
    """A small corpus folder of made-up English and Chinese documents."""
    rng = np.random.default_rng(0)
    words = EN.replace(",", "").replace(".", "").split()
    splits = {"train": [], "heldout": []}
    for i in range(n_docs):
        paras = [" ".join(rng.choice(words, 24)) + "." for _ in range(6)] + [ZH]
        splits["heldout" if i == n_docs // 2 else "train"].append(
            {"source": "austen" if i % 2 else "songci", "doc": str(i), "text": "\n".join(paras)})
    corpus_mod.write_corpus_folder(folder, splits, {"sources": []})
    return folder


TINY = recipes.get("ci-tiny")


# ---- corpus ----------------------------------------------------------------------------------------------
def _r_serialize_strings(values: list[str]) -> bytes:
    """An R XDR serialization (version 2) of a character vector, as R's saveRDS writes one."""
    out = b"X\n" + struct.pack(">iii", 2, 0x040000, 0x020300) + struct.pack(">ii", 16, len(values))
    for v in values:
        b = v.encode()
        out += struct.pack(">ii", 9 | (1 << 15), len(b)) + b  # a CHARSXP marked UTF-8
    return out


def _r_index(objects: dict[str, tuple[int, int]]) -> bytes:
    """The .rdx index: a named list(variables = named list of (offset, length) int vectors)."""
    def int_vec(xs):
        return struct.pack(">ii", 13, len(xs)) + b"".join(struct.pack(">i", x) for x in xs)

    def sym(name):
        b = name.encode()
        return struct.pack(">i", 1) + struct.pack(">ii", 9, len(b)) + b

    def str_vec(xs):
        return struct.pack(">ii", 16, len(xs)) + b"".join(struct.pack(">ii", 9, len(x.encode())) + x.encode()
                                                           for x in xs)

    def named_list(items):  # VECSXP with a names attribute (a pairlist tagged "names")
        body = struct.pack(">ii", 19 | (1 << 9), len(items)) + b"".join(v for _, v in items)
        return body + struct.pack(">i", 2 | (1 << 10)) + sym("names") + str_vec([k for k, _ in items]) + \
            struct.pack(">i", 254)

    variables = named_list([(k, int_vec(list(v))) for k, v in objects.items()])
    return b"X\n" + struct.pack(">iii", 2, 0x040000, 0x020300) + named_list([("variables", variables)])


def test_rdata_reads_a_lazyload_database(tmp_path):
    blobs, index, offset = b"", {}, 0
    novels = {"emma": ["EMMA", "", "CHAPTER I", "Emma Woodhouse, handsome, clever, and rich", "café"],
              "persuasion": ["Persuasion", "Sir Walter Elliot"]}
    for name, lines in novels.items():
        payload = _r_serialize_strings(lines)
        blob = struct.pack(">i", len(payload)) + zlib.compress(payload)
        index[name] = (offset, len(blob))
        blobs += blob
        offset += len(blob)
    (tmp_path / "Rdata.rdb").write_bytes(blobs)
    gz = zlib.compressobj(wbits=31)
    (tmp_path / "Rdata.rdx").write_bytes(gz.compress(_r_index(index)) + gz.flush())
    assert read_lazyload(str(tmp_path / "Rdata.rdb"), str(tmp_path / "Rdata.rdx")) == novels
    (tmp_path / "Rdata.rdb").write_bytes(blobs[:-5])
    with pytest.raises(RDataError, match="persuasion"):
        read_lazyload(str(tmp_path / "Rdata.rdb"), str(tmp_path / "Rdata.rdx"))


def test_heldout_is_about_two_percent_spread_out():
    held = corpus_mod.heldout_indices(269)
    assert len(held) == 5 and min(held) > 0 and max(held) < 268
    assert len(corpus_mod.heldout_indices(20609)) == 412 and corpus_mod.heldout_indices(1) == set()


def test_corpus_folder_is_checked_against_its_manifest(tmp_path):
    folder = write_corpus(str(tmp_path / "c"))
    assert len(corpus_mod.load_corpus(folder, "heldout")) == 1
    with open(os.path.join(folder, "train.jsonl"), "a") as f:
        f.write('{"source": "x", "doc": "y", "text": "edited"}\n')
    with pytest.raises(corpus_mod.CorpusError, match="train.jsonl: sha256 differs"):
        corpus_mod.load_corpus(folder, "train")
    os.remove(os.path.join(folder, "heldout.jsonl"))
    with pytest.raises(corpus_mod.CorpusError, match="heldout.jsonl: missing"):
        corpus_mod.load_corpus(folder, "heldout")
    with pytest.raises(corpus_mod.CorpusError, match="no manifest.json"):
        corpus_mod.load_corpus(str(tmp_path), "train")


def test_fetch_checks_the_pinned_hash_and_names_a_missing_tool(tmp_path, monkeypatch):
    src = corpus_mod.SOURCES[0]
    (tmp_path / src.archive).write_bytes(b"not the package")
    with pytest.raises(corpus_mod.CorpusError, match=f"{src.archive}: sha256 .* is not the pinned"):
        corpus_mod.fetch(src, str(tmp_path))
    os.remove(tmp_path / src.archive)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(corpus_mod.CorpusError, match="'apt-get' is not installed.*r-cran-janeaustenr"):
        corpus_mod.fetch(src, str(tmp_path))


def test_chat_turns_pair_consecutive_paragraphs_of_prose_and_verse_not_drama():
    verse = {"source": "songci", "text": "\n".join("abcdefghijklmnopqrstuvwxyz")}
    prose = {"source": "austen", "text": "a\nb\nc"}
    drama = {"source": "shakespeare", "text": "Ber.\nWho's there?\n\nFran.\nNay, answer me."}
    assert chat_turns([verse, prose, drama]) == [("a", "b"), ("m", "n"), ("y", "z"), ("a", "b"), ("b", "c")]


def test_batches_depend_only_on_seed_and_step():
    stream = np.arange(1000, dtype=np.int32)
    a, b = batch_at(stream, 7, 0, 4, 34), batch_at(stream, 7, 0, 4, 34)
    assert np.array_equal(a, b) and a.shape == (4, 34) and not np.array_equal(a, batch_at(stream, 8, 0, 4, 34))
    assert np.all(np.diff(a, axis=1) == 1)  # contiguous windows of the stream


# ---- training --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory):
    return write_corpus(str(tmp_path_factory.mktemp("corpus")))


@pytest.fixture(scope="module")
def tiny_run(tiny_corpus, tmp_path_factory):
    run = str(tmp_path_factory.mktemp("run"))
    last = train(tiny_corpus, run, "ci-tiny", eval_every=4, quiet=True)
    return run, last


def test_tiny_training_lowers_the_loss_and_writes_a_run(tiny_run):
    run, last = tiny_run
    rows = [json.loads(line) for line in open(os.path.join(run, "log.jsonl"))]
    assert [r["step"] for r in rows] == list(range(1, TINY.train.steps + 1)) and last["step"] == TINY.train.steps
    assert rows[-1]["lm_loss"] < rows[0]["lm_loss"] - 0.5 and rows[-1]["mtp_loss"] < rows[0]["mtp_loss"]
    assert rows[-1]["heldout_lm_loss"] < rows[3]["heldout_lm_loss"]
    assert all(np.isfinite(r["grad_norm"]) for r in rows)
    assert os.path.getsize(os.path.join(run, "loss.png")) > 1000
    cfg, params, info = load_trained(run)
    assert info["step"] == TINY.train.steps and cfg.vocab_size % 128 == 0
    biases = [np.asarray(s["router_bias"]) for s in params["segments"] if "router_bias" in s]
    assert biases and all(np.any(b != 0) for b in biases)  # balancing moved the correction bias


def test_resume_continues_exactly(tiny_corpus, tiny_run, tmp_path):
    run, _ = tiny_run
    part = str(tmp_path / "part")
    train(tiny_corpus, part, "ci-tiny", eval_every=4, stop_after=3, quiet=True)
    assert load_trained(part)[2]["step"] == 3
    train(tiny_corpus, part, "ci-tiny", eval_every=4, quiet=True)  # the same command again resumes
    full = [json.loads(line) for line in open(os.path.join(run, "log.jsonl"))]
    resumed = [json.loads(line) for line in open(os.path.join(part, "log.jsonl"))]
    drop = lambda rows: [{k: v for k, v in r.items() if k != "seconds"} for r in rows]  # noqa: E731
    assert drop(resumed) == drop(full)
    (_, a, _), (_, b, _) = load_trained(run), load_trained(part)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_run_folder_of_another_config_is_refused(tiny_corpus, tiny_run, monkeypatch):
    run, _ = tiny_run
    other = dataclasses.replace(TINY, model={**TINY.model, "hidden_size": 128, "head_dim": 32})
    monkeypatch.setitem(recipes.RECIPES, "ci-tiny", other)
    with pytest.raises(RunError, match=r"model_config.head_dim differs"):
        train(tiny_corpus, run, "ci-tiny", quiet=True)


def test_vocab_smaller_than_the_tokenizer_is_refused(tiny_corpus, tmp_path, monkeypatch):
    small = dataclasses.replace(TINY, model={**TINY.model, "vocab_size": 256})
    monkeypatch.setitem(recipes.RECIPES, "ci-tiny", small)
    with pytest.raises(RunError, match=r"vocab_size 256 is smaller than the tokenizer's \d+ pieces"):
        train(tiny_corpus, str(tmp_path / "run"), "ci-tiny", quiet=True)
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_corpus_with_more_characters_than_the_recipe_has_pieces_is_refused(tmp_path):
    # 600 distinct CJK characters, each frequent enough to need a piece of its own, against 384 pieces
    text = "".join(chr(0x4E00 + i) for i in range(600)) * 3
    corpus_mod.write_corpus_folder(str(tmp_path / "corpus"), {
        "train": [{"source": "songci", "doc": str(i), "text": text} for i in range(2)],
        "heldout": [{"source": "songci", "doc": "h", "text": text}]}, {"sources": []})
    corpus = str(tmp_path / "corpus")
    with pytest.raises(RunError, match=r"recipe ci-tiny: its tokenizer is too small .*384 pieces cannot hold this "
                                       r"text's \d+ required pieces"):
        train(corpus, str(tmp_path / "run"), "ci-tiny", quiet=True)
    assert os.listdir(tmp_path / "run") == []  # no tokenizer, run.json or checkpoint written


def test_release_of_a_folder_without_checkpoint_writes_nothing(tmp_path):
    from ernie_jax.train.release import build
    os.makedirs(tmp_path / "run")
    with pytest.raises(RunError, match="no run.json"):
        build(str(tmp_path / "run"), str(tmp_path / "model"))
    assert not os.path.exists(tmp_path / "model")


def test_mesh_step_matches_one_device_step():
    """A data=2 x expert=4 step on 8 fake devices (the serving rules' batch and expert axes) takes the same
    step as one device: same loss, same updated weights (f32 compute)."""
    from ernie_jax.sharding import ShardingPlan, make_mesh
    from ernie_jax.train.run import batch_on, place

    cfg = ErnieConfig.from_dict({**TINY.model, "vocab_size": 384})
    tc = dataclasses.replace(TINY.train, compute_dtype="float32", batch_size=4)
    tokens = np.random.default_rng(0).integers(3, 384, (4, tc.seq_len + 2)).astype(np.int32)
    one, m1 = train_step(init_state(init_params(cfg, 0), tc), jnp.asarray(tokens), cfg=cfg, tc=tc)
    plan = ShardingPlan.create(make_mesh("data=2,expert=4,tensor=1"))
    state = place(init_state(init_params(cfg, 0), tc), plan)
    eight, m8 = train_step(state, batch_on(tokens, plan), cfg=cfg, tc=tc, plan=plan)
    assert len(eight.params["embed"].sharding.device_set) == 8
    np.testing.assert_allclose(float(m8.loss), float(m1.loss), rtol=1e-5)
    np.testing.assert_allclose(float(m8.grad_norm), float(m1.grad_norm), rtol=1e-4)
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(eight.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5)


# ---- evaluation ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,max_len", [(1, 4), (5, 4), (8, 4), (9, 4), (30, 7)])
def test_rolling_windows_score_every_token_once_with_maximal_context(n, max_len):
    tokens = list(range(10, 10 + n))
    windows = rolling_windows(tokens, 1, max_len)
    scored = []
    for seq, span in windows:
        assert len(seq) <= max_len + 1 and 1 <= span <= max_len
        inputs, targets = seq[:-1], seq[1:]
        scored += targets[len(targets) - span:]
        if len(scored) > max_len:  # later windows see a full context
            assert len(inputs) == max_len
    assert scored == tokens
    assert windows[0][0][0] == 1  # the first token is predicted from the prefix token


def test_evaluate_names_an_unknown_variant(capsys):
    from ernie_jax.train.evaluate import main
    with pytest.raises(SystemExit):
        main(["--bf16", "x", "--fp8", "y", "--corpus", "z", "--variants", "fp8 w8a8,fp9"])
    assert "unknown ['fp9']" in capsys.readouterr().err
