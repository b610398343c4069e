"""Stop strings are checked inside the engine on the detokenized text: a stop string spanning
token boundaries ends the request in the step that completes it, the output (streamed or final)
never holds text past it, and include_stop_str_in_output keeps exactly the stop string. (vLLM's
finer rules -- stop-token text, min_tokens, list order -- are in test_vllm_semantics.py.)"""
from __future__ import annotations

import numpy as np

from engine_helpers import TINY_VOCAB, PieceTokenizer, greedy, make_engine
from pagedrun.runtime.llm import _merge

def _stream(engine, prompt, params):
    """Run one request; returns (final output, list of accumulated texts after each delta)."""
    engine.add_request("s", prompt_token_ids=prompt, sampling_params=params)
    total, texts = None, []
    while engine.has_unfinished_requests():
        for delta in engine.step():
            total = _merge(total, delta)
            texts.append(total.outputs[0].text)
    return total, texts


def _boundary_spanning_stop(tokenizer, tokens, text):
    """A 3-4 character substring of text that crosses a token boundary, and where the first
    occurrence of it ends (the number of tokens needed to complete it)."""
    ends = np.cumsum([len(tokenizer.pieces[t]) for t in tokens])
    for k in range(8, len(tokens) - 1):
        b = int(ends[k])
        stop = text[b - 2:b + 2]
        if len(stop) == 4 and stop.strip():
            idx = text.find(stop)
            num_tokens = int(np.searchsorted(ends, idx + len(stop))) + 1
            return stop, idx, num_tokens
    raise AssertionError("no boundary-spanning stop string found")


def test_stop_string_spanning_tokens(tiny_model):
    tokenizer = PieceTokenizer()
    prompt = np.random.default_rng(2).integers(3, TINY_VOCAB, 20).tolist()
    engine = make_engine(tiny_model, tokenizer, num_kv_blocks=64, max_model_len=512)
    full, _ = _stream(engine, prompt, greedy(40))
    tokens, text = full.outputs[0].token_ids, full.outputs[0].text
    assert text == tokenizer.decode(tokens, skip_special_tokens=True)
    stop, idx, num_tokens = _boundary_spanning_stop(tokenizer, tokens, text)

    out, texts = _stream(engine, prompt, greedy(40, stop=[stop, "never-there"]))
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == text[:idx]
    assert c.token_ids == tokens[:num_tokens]
    assert all(text[:idx].startswith(t) for t in texts)  # never streamed past the stop

    out, texts = _stream(engine, prompt, greedy(40, stop=[stop], include_stop_str_in_output=True))
    assert out.outputs[0].text == text[:idx + len(stop)]
    assert out.outputs[0].token_ids == tokens[:num_tokens]
    assert all(text[:idx + len(stop)].startswith(t) for t in texts)


def test_stop_string_completed_first_wins_and_single_char_stop(tiny_model):
    """Of two stop strings completed by different tokens, the one completed first ends the
    request whatever the list order (list order decides only between stop strings completed
    by the same token: tests/engine/test_vllm_semantics.py)."""
    tokenizer = PieceTokenizer(seed=1)
    prompt = np.random.default_rng(4).integers(3, TINY_VOCAB, 9).tolist()
    engine = make_engine(tiny_model, tokenizer, num_kv_blocks=64, max_model_len=512)
    full, _ = _stream(engine, prompt, greedy(60))
    text = full.outputs[0].text
    late, early = text[40:43], text[10:12]
    expected_end = min(text.find(late), text.find(early))
    out, _ = _stream(engine, prompt, greedy(60, stop=[late, early]))
    assert out.outputs[0].text == text[:expected_end]
    char = text[5]
    out, _ = _stream(engine, prompt, greedy(60, stop=[char]))
    assert out.outputs[0].text == text[:text.find(char)]
    assert out.outputs[0].finish_reason == "stop"
