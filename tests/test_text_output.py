"""Text-level behaviour on the demo model (it has a tokenizer): stop strings, streaming, chat."""

from __future__ import annotations

import pytest

from hylo import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def llm(shallow_model_dir):
    """The 3-layer cut of the random test model (conftest `shallow_model_dir`): the tokenizer's, the
    detokenizer's and the stops' behaviour does not depend on the depth, and each step costs ~40% of
    the 8-layer model's."""
    return LLM(str(shallow_model_dir), device="cpu", page_size=16)


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(**({"temperature": 0, "max_tokens": 40, "ignore_eos": True} | kwargs))


@pytest.fixture(scope="module")
def full(llm):
    """PROMPT's greedy output without stops, which the stop tests cut (computed once: greedy decoding of
    the same prompt gives the same tokens every time, which the tests below assert)."""
    (out,) = llm.generate(PROMPT, greedy(), use_tqdm=False)
    return out


def straddling_stop(llm, token_ids) -> tuple[str, str]:
    """The full greedy text and a 3-character stop string that spans a token boundary in it."""
    tok = llm.tokenizer
    text = tok.decode(token_ids)
    for j in range(2, len(token_ids) - 2):
        head = tok.decode(token_ids[:j])
        stop = text[len(head) - 1 : len(head) + 2]
        clean = text.startswith(head) and len(tok.decode(token_ids[j : j + 1])) >= 2
        if clean and len(head) > 1 and len(stop) == 3 and "\ufffd" not in stop:
            return text, stop
    raise AssertionError("no clean token boundary in the greedy text")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_token_boundary_cuts_exactly(llm, full, include):
    text, stop = straddling_stop(llm, full.token_ids)
    (out,) = llm.generate(PROMPT, greedy(stop=[stop], include_stop_str_in_output=include), use_tqdm=False)
    cut = text.index(stop) + (len(stop) if include else 0)
    assert out.finish_reason == "stop"
    assert out.text == text[:cut]
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert llm.tokenizer.decode(out.token_ids).startswith(text[: text.index(stop) + len(stop)])


def test_streamed_text_never_leaks_a_stop_string(llm, full):
    text, stop = straddling_stop(llm, full.token_ids)
    engine = llm.engine
    engine.add_request("s", llm.tokenizer.encode(PROMPT), greedy(stop=[stop, "never-appears"]))
    pieces = []
    while engine.has_unfinished():
        pieces.extend(out.new_text for out in engine.step())
    streamed = "".join(pieces)
    assert streamed == text[: text.index(stop)]
    assert stop not in streamed


def test_stream_equals_final_text_without_stops(llm):
    engine = llm.engine
    requests = engine.add_request("t", llm.tokenizer.encode(PROMPT), greedy(max_tokens=30))
    pieces = []
    while engine.has_unfinished():
        pieces.extend(out.new_text for out in engine.step())
    assert "".join(pieces) == requests[0].text
    assert "\ufffd" not in requests[0].text or "\ufffd" in llm.tokenizer.decode(requests[0].output_ids)


def test_chat_applies_the_template(llm):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    (out,) = llm.chat(messages, greedy(max_tokens=8), use_tqdm=False)
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert out.prompt_token_ids == prompt
    (direct,) = llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(max_tokens=8), use_tqdm=False)
    assert out.token_ids == direct.token_ids
    with pytest.raises(ValueError, match="message 0"):
        llm.chat([{"role": "user"}], greedy(), use_tqdm=False)


# The demo model's end-of-sequence tokens: tokenizer_config.json's eos_token, and the turn ends its
# generation_config.json lists as eos_token_id (`write_random_model`).
@pytest.mark.parametrize("name", ["<|endoftext|>", "<|user|>", "<|observation|>"])
def test_the_models_eos_token_ends_a_request(llm, name):
    """With no stop_token_ids, the model's end-of-sequence token stops a request where it is picked.
    A logit bias makes it the greedy pick at every step; `min_tokens` keeps it out of the first three,
    so the request ends on a decode step, with the token as its last."""
    eos = llm.tokenizer.token_to_id(name)
    assert name != "<|endoftext|>" or llm.tokenizer.eos_token == name
    biased = dict(temperature=0, max_tokens=12, logit_bias={eos: 100.0})
    (out,) = llm.generate(PROMPT, SamplingParams(**biased, min_tokens=3), use_tqdm=False)
    assert out.finish_reason == "stop"
    assert len(out.token_ids) == 4 and out.token_ids[3] == eos and eos not in out.token_ids[:3]
    # the same picks, end of sequence ignored: the token every step, up to the limit
    (ignored,) = llm.generate(PROMPT, SamplingParams(**biased, ignore_eos=True), use_tqdm=False)
    assert ignored.finish_reason == "length" and ignored.token_ids == [eos] * 12


def test_stop_token_ids_stop_generation(llm, full):
    stop = full.token_ids[2]
    (out,) = llm.generate(PROMPT, greedy(stop_token_ids=[stop]), use_tqdm=False)
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop) + 1]
