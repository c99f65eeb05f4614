"""`hylo bench serve --dataset-name random`: prompts of exactly the requested number of tokens of the
served model's tokenizer, counted as the server counts them."""

from __future__ import annotations

import argparse

import pytest

from hylo.bench import datasets
from hylo.bench.datasets import random_dataset
from hylo.bench.serving import _tokenizer_dir
from hylo.models.demo import DEMO_DIR
from hylo.tokenizer import _DEMO_CORPUS, _DEMO_MERGE_VOCAB, Tokenizer, write_byte_level_bpe


@pytest.fixture(scope="module")
def demo_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEMO_DIR)


def test_random_prompts_have_the_requested_token_count(demo_tokenizer):
    requests = random_dataset(demo_tokenizer, 40, 300, 16, 0.1, seed=3)
    lengths = [r.prompt_len for r in requests]
    assert min(lengths) < 100 and max(lengths) > 200  # drawn from [30, 300]
    assert [len(demo_tokenizer.encode(r.prompt)) for r in requests] == lengths
    assert all(1 <= r.output_len <= 16 for r in requests)
    fixed = random_dataset(demo_tokenizer, 4, 7, 5, 1.0, seed=0)
    assert [(len(demo_tokenizer.encode(r.prompt)), r.output_len) for r in fixed] == [(7, 5)] * 4
    assert random_dataset(demo_tokenizer, 4, 7, 5, 1.0, seed=0) == fixed  # seeded
    assert len(set(demo_tokenizer.encode("".join(r.prompt for r in requests)))) > 500  # varied tokens


def test_random_prompts_count_a_bos_the_tokenizer_adds(tmp_path, monkeypatch):
    """A tokenizer that adds BOS (counted by the server's usage) and has few whole-word tokens: the
    general path (any token, lengths adjusted) reaches the exact count too."""
    write_byte_level_bpe(
        tmp_path, _DEMO_CORPUS.split("\n\n"), _DEMO_MERGE_VOCAB, extra_config={"add_bos_token": True}
    )
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.encode("hello")[0] == tokenizer.bos_token_id
    for min_words in (datasets._MIN_WORD_TOKENS, 10**9):  # whole-word tokens, then any token
        monkeypatch.setattr(datasets, "_MIN_WORD_TOKENS", min_words)
        requests = random_dataset(tokenizer, 20, 40, 4, 0.25, seed=1)
        assert [len(tokenizer.encode(r.prompt)) for r in requests] == [r.prompt_len for r in requests]


def test_random_dataset_refuses_bad_lengths_by_name(demo_tokenizer):
    with pytest.raises(ValueError, match="input_len"):
        random_dataset(demo_tokenizer, 1, 0, 4, 1.0, seed=0)
    with pytest.raises(ValueError, match=r"range_ratio must be in \[0, 1\]"):
        random_dataset(demo_tokenizer, 1, 4, 4, 1.5, seed=0)


def test_tokenizer_comes_from_the_flag_or_the_model_directory(tmp_path):
    args = argparse.Namespace(
        tokenizer=str(tmp_path), model=None, base_url="http://127.0.0.1:9", api_key=None
    )
    assert _tokenizer_dir(args) == tmp_path
    assert (
        _tokenizer_dir(argparse.Namespace(**{**vars(args), "tokenizer": None, "model": str(DEMO_DIR)}))
        == DEMO_DIR
    )
    nothing = argparse.Namespace(**{**vars(args), "tokenizer": None})  # no server answers on port 9
    with pytest.raises(ValueError, match="pass --tokenizer DIR"):
        _tokenizer_dir(nothing)
