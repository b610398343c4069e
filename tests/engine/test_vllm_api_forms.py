"""vLLM's API forms (issue 37 item 7): code written for vLLM runs on its first call.

Each prompt form of `LLM.generate` (vllm/inputs/data.py PromptType: str, token ids, TextPrompt,
TokensPrompt, lists mixing them), each form of `LLM.chat`'s messages, the keywords and
positions of both (vllm/entrypoints/llm.py), the vLLM SamplingParams fields we take or refuse,
runtime/prompt_inputs.py's normalization on its own, and LLMEngine.add_request in vLLM's
positional form `add_request(request_id, prompt, params, arrival_time, lora_request)`.

Expected tokens come from the dense reference model (reference_greedy over the ids the test's
own tokenizer gives), never from the engine under test; refusals are checked to leave nothing
admitted.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from engine_helpers import TINY_VOCAB, PieceTokenizer, greedy, make_engine, reference_greedy
from pagedrun.runtime.chat_options import ChatOptionsError
from pagedrun.runtime.errors import RequestError
from pagedrun.runtime.llm import LLM
from pagedrun.runtime.lora.lora_request import LoRARequest
from pagedrun.runtime.prompt_inputs import (PromptInput, PromptInputError, parse_conversations,
                                            parse_prompts, resolve_request_prompt)
from pagedrun.runtime.sampling_params import SamplingParams, SamplingParamsError

BOS = 1
IDS_A = [17, 250, 33, 91, 120, 7]
IDS_B = [5, 66, 201, 12, 300]


class TextTokenizer(PieceTokenizer):
    """PieceTokenizer with an encoder and a chat template, simple enough to restate in the
    tests: character c is token 3 + ord(c) mod (vocab - 3); add_special_tokens prepends BOS.
    The template writes "[role]content\\n" per message (a list of text parts as the parts
    joined by "|", so the two content formats render differently), then "[assistant]" for a
    generation prompt."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [3 + ord(c) % (TINY_VOCAB - 3) for c in text]
        return ([BOS] if add_special_tokens else []) + ids

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, *,
                            chat_template=None, continue_final_message=False, tools=None,
                            **template_kwargs):
        def content(value):
            return "|".join(p["text"] for p in value) if isinstance(value, list) else value

        text = "".join(f"[{m['role']}]{content(m['content'])}\n" for m in messages)
        text += "[assistant]" if add_generation_prompt else ""
        return self.encode(text, add_special_tokens=False) if tokenize else text


@pytest.fixture(scope="module")
def llm(tiny_cpu_model):
    engine = make_engine(tiny_cpu_model, TextTokenizer(), dtype="float32", num_kv_blocks=64,
                         max_model_len=256)
    return LLM.from_engine(engine)


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def expect(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    return [reference_greedy(model, p, max_tokens) for p in prompts]


def assert_nothing_admitted(llm) -> None:
    assert not llm.engine.has_unfinished_requests()
    stats = llm.engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


# ------------------------------------------------------------------------- generate's forms

def test_tokens_prompt_dict_runs(llm, tiny_cpu_model):
    """The issue's example: LLM.generate([{"prompt_token_ids": [...]}]) was refused with
    "prompt_token_ids must be a list of ints"."""
    (out,) = llm.generate([{"prompt_token_ids": IDS_A}], greedy(5))
    assert out.prompt_token_ids == IDS_A
    assert out.outputs[0].token_ids == reference_greedy(tiny_cpu_model, IDS_A, 5)
    assert out.prompt is None  # token ids carry no text (vLLM's RequestOutput.prompt)
    (one,) = llm.generate({"prompt_token_ids": IDS_B}, greedy(3))  # one dict, not in a list
    assert one.outputs[0].token_ids == reference_greedy(tiny_cpu_model, IDS_B, 3)


def test_every_prompt_form_alone_and_mixed(llm, tiny_cpu_model):
    """str, list[str], list[int], list[list[int]], TextPrompt, TokensPrompt (with and without
    its text), numpy ints, a tuple batch, and one list mixing them all: each prompt runs the
    ids the tokenizer gives for it, outputs in input order, `prompt` as vLLM fills it."""
    tok = TextTokenizer()
    text = "ab c."
    text_ids = tok.encode(text)
    forms = {
        "str": (text, [text_ids], [text]),
        "list of str": ([text, "c.a"], [text_ids, tok.encode("c.a")], [text, "c.a"]),
        "token ids": (IDS_A, [IDS_A], [None]),
        "list of token ids": ([IDS_A, IDS_B], [IDS_A, IDS_B], [None, None]),
        "numpy ids": ([list(np.array(IDS_A, dtype=np.int64)),
                       list(np.array(IDS_B, dtype=np.int32))], [IDS_A, IDS_B], [None, None]),
        "tuple batch": ((text, IDS_B), [text_ids, IDS_B], [text, None]),
        "TextPrompt": ({"prompt": text}, [text_ids], [text]),
        "TokensPrompt with text": ({"prompt_token_ids": IDS_B, "prompt": "shown"}, [IDS_B],
                                   ["shown"]),
        "mixed": ([text, IDS_A, {"prompt": "c.a"}, {"prompt_token_ids": IDS_B}],
                  [text_ids, IDS_A, tok.encode("c.a"), IDS_B], [text, None, "c.a", None]),
    }
    for name, (prompts, ids, shown) in forms.items():
        outs = llm.generate(prompts, greedy(4))
        assert [o.prompt_token_ids for o in outs] == ids, name
        assert tokens_of(outs) == expect(tiny_cpu_model, ids, 4), name
        assert [o.prompt for o in outs] == shown, name
        assert all(o.finished for o in outs), name
    assert llm.generate([], greedy(2)) == []
    assert_nothing_admitted(llm)


@pytest.mark.parametrize("prompts, message", [
    (["ab", {"prompt": "x", "multi_modal_data": {"image": object()}}],
     r"prompts\[1\]\['multi_modal_data'\]: multi-modal inputs are not supported"),
    (["ab", {"prompt_token_ids": [5], "mm_processor_kwargs": {"a": 1}}], "multi-modal"),
    (["ab", {"prompt_embeds": [[0.0]]}], "embedding prompts"),
    (["ab", {"encoder_prompt": "x", "decoder_prompt": None}], "decoder-only"),
    (["ab", {"prompt_token_ids": [5], "token_type_ids": [0]}], "cross-encoder"),
    (["ab", {"prompt": "x", "cache_salt": "s"}], "cache_salt"),
    (["ab", {"prompt": "x", "suffix": "y"}], r"prompts\[1\]: unknown key\(s\) 'suffix'"),
    (["ab", {}], "needs 'prompt'"),
    (["ab", {"prompt": 5}], r"\['prompt'\]: must be a string, got int"),
    (["ab", {"prompt_token_ids": "abc"}], "must be a list of token ids"),
    (["ab", {"prompt_token_ids": [5, 1.0]}],
     r"prompts\[1\]\['prompt_token_ids'\]\[1\]: a token id must be an int, got float"),
    (["ab", [5, True]], r"prompts\[1\]\[1\]: a token id must be an int, got bool"),
    ([5, True], r"prompts\[0\]: must be a string, a list of token ids"),  # 5 is no prompt
    (["ab", None], r"prompts\[1\]: must be a string.*got NoneType"),
    (b"bytes", "prompts: must be a prompt or a list of prompts; got bytes"),
    (np.array(IDS_A), "got ndarray"),
    (None, "got NoneType"),
])
def test_refused_prompt_forms(llm, prompts, message):
    """What the engine cannot serve is a ValueError naming the prompt and the reason; a good
    prompt before it in the batch is not admitted either (all or nothing)."""
    with pytest.raises(PromptInputError, match=message):
        llm.generate(prompts, greedy(2))
    assert_nothing_admitted(llm)


def test_none_valued_optional_keys_are_absent():
    """A key given as None is "not given" (code that builds the dict generically), as in
    vLLM's TypedDicts' NotRequired fields."""
    (p,) = parse_prompts({"prompt": "x", "multi_modal_data": None, "cache_salt": None})
    assert p == PromptInput(prompt="x")


def test_sampling_params_one_or_one_per_prompt(llm, tiny_cpu_model):
    """vLLM: a single SamplingParams serves every prompt, a list pairs one with each prompt;
    a list of another length is an error and nothing runs. The caller's objects keep their
    output_kind (the offline loop runs copies)."""
    params = [greedy(2), greedy(5)]
    outs = llm.generate([IDS_A, IDS_B], params)
    assert tokens_of(outs) == [reference_greedy(tiny_cpu_model, IDS_A, 2),
                               reference_greedy(tiny_cpu_model, IDS_B, 5)]
    with pytest.raises(ValueError, match="2 prompts but 3 sampling_params"):
        llm.generate([IDS_A, IDS_B], [greedy(2)] * 3)
    with pytest.raises(ValueError, match=r"sampling_params\[1\]: must be a SamplingParams"):
        llm.generate([IDS_A, IDS_B], [greedy(2), {"max_tokens": 2}])
    with pytest.raises(ValueError, match="sampling_params: must be a SamplingParams"):
        llm.generate([IDS_A], {"max_tokens": 2})
    assert_nothing_admitted(llm)
    (default,) = llm.generate(IDS_A, None)
    assert len(default.outputs[0].token_ids) <= SamplingParams().max_tokens == 16
    assert llm.get_default_sampling_params() == SamplingParams()


def test_lora_request_forms_are_checked_before_admission(llm):
    """lora_request: one for all or one per prompt (vLLM); a wrong length or type is refused
    before anything runs (the engine here has LoRA off, so an adapter itself would be refused
    at admission)."""
    lora = LoRARequest("a", 1, "/nowhere")
    with pytest.raises(ValueError, match="2 prompts but 1 lora_requests"):
        llm.generate([IDS_A, IDS_B], greedy(2), lora_request=[lora])
    with pytest.raises(ValueError, match=r"lora_request\[0\]: must be a LoRARequest"):
        llm.generate([IDS_A], greedy(2), lora_request=["a"])
    outs = llm.generate([IDS_A, IDS_B], greedy(2), lora_request=[None, None])
    assert len(outs) == 2
    assert_nothing_admitted(llm)


def test_priority_and_tokenization_kwargs(llm, tiny_cpu_model):
    """priority (vLLM: one int per prompt, used by priority scheduling): all zeros run, a
    non-zero one is refused (the engine schedules first come, first served), as is a list of
    the wrong length. tokenization_kwargs: add_special_tokens is honoured for text prompts;
    other keys are refused."""
    tok = TextTokenizer()
    outs = llm.generate(["ab", IDS_A], greedy(3), priority=[0, 0])
    assert tokens_of(outs) == expect(tiny_cpu_model, [tok.encode("ab"), IDS_A], 3)
    with pytest.raises(ValueError, match="priority scheduling is not supported"):
        llm.generate(["ab", IDS_A], greedy(3), priority=[0, 1])
    with pytest.raises(ValueError, match="list of 2 ints"):
        llm.generate(["ab", IDS_A], greedy(3), priority=[0])

    no_bos = tok.encode("ab c", add_special_tokens=False)
    assert no_bos[0] != BOS
    outs = llm.generate(["ab c", IDS_A], greedy(3),
                        tokenization_kwargs={"add_special_tokens": False})
    assert [o.prompt_token_ids for o in outs] == [no_bos, IDS_A]
    assert tokens_of(outs) == expect(tiny_cpu_model, [no_bos, IDS_A], 3)
    assert outs[0].prompt == "ab c"
    (with_bos,) = llm.generate("ab c", greedy(1), tokenization_kwargs={"add_special_tokens": True})
    assert with_bos.prompt_token_ids == [BOS] + no_bos
    with pytest.raises(ValueError, match="'truncation' not supported"):
        llm.generate("ab", greedy(1), tokenization_kwargs={"truncation": True})
    with pytest.raises(ValueError, match="add_special_tokens must be a boolean"):
        llm.generate("ab", greedy(1), tokenization_kwargs={"add_special_tokens": 1})
    assert_nothing_admitted(llm)


def test_use_tqdm(llm):
    """use_tqdm: False, True (a bar on stderr when it is a terminal), or a callable that
    makes the bar (vLLM's form): it gets the number of requests and one update per finished
    request. Anything else is refused before a request is admitted."""
    made = []

    class Bar:
        def __init__(self, total, **kwargs):
            self.total, self.updates, self.closed = total, 0, False
            made.append(self)

        def update(self, n):
            self.updates += n

        def close(self):
            self.closed = True

    outs = llm.generate([IDS_A, IDS_B, "ab"], greedy(2), use_tqdm=Bar)
    assert len(outs) == 3
    assert [(b.total, b.updates, b.closed) for b in made] == [(3, 3, True)]
    for flag in (True, False):
        assert len(llm.generate([IDS_A], greedy(2), use_tqdm=flag)) == 1
    with pytest.raises(ValueError, match="use_tqdm"):
        llm.generate([IDS_A], greedy(2), use_tqdm="yes")
    assert_nothing_admitted(llm)


# ------------------------------------------------------------------------------ chat's forms

def test_chat_one_conversation_or_many(llm, tiny_cpu_model):
    """messages: one conversation (a list of message dicts) or a list of them; each runs the
    ids of its rendered template; RequestOutput.prompt is the rendered text (vLLM)."""
    tok = TextTokenizer()
    one = [{"role": "user", "content": "ab"}]
    two = [{"role": "system", "content": "c."}, {"role": "user", "content": "a"}]
    text_one, text_two = "[user]ab\n[assistant]", "[system]c.\n[user]a\n[assistant]"
    ids = [tok.encode(t, add_special_tokens=False) for t in (text_one, text_two)]
    (single,) = llm.chat(one, greedy(3))
    assert single.prompt == text_one and single.prompt_token_ids == ids[0]
    assert single.outputs[0].token_ids == reference_greedy(tiny_cpu_model, ids[0], 3)
    outs = llm.chat([one, two], [greedy(3), greedy(4)])
    assert [o.prompt for o in outs] == [text_one, text_two]
    assert tokens_of(outs) == [reference_greedy(tiny_cpu_model, ids[0], 3),
                               reference_greedy(tiny_cpu_model, ids[1], 4)]
    assert one == [{"role": "user", "content": "ab"}]  # the caller's messages are untouched


def test_chat_positional_order_and_options(llm):
    """vLLM's LLM.chat takes (messages, sampling_params, use_tqdm, lora_request,
    chat_template, chat_template_content_format, add_generation_prompt, ...) by position."""
    conversation = [{"role": "user", "content": "ab"}]
    (out,) = llm.chat(conversation, greedy(2), False, None, None, "string", False)
    assert out.prompt == "[user]ab\n"  # add_generation_prompt=False, seventh position
    with pytest.raises(ChatOptionsError, match="cannot both be True"):
        llm.chat(conversation, greedy(2), continue_final_message=True)
    assert_nothing_admitted(llm)


def test_chat_content_parts_and_formats(llm):
    """Text parts of a message's content: "string" and "auto" join them with a newline
    (vLLM's joiner), "openai" hands the template the list of parts; a bare string part is a
    text part; an image part, mm_processor_kwargs and add_special_tokens=True are refused."""
    conversation = [{"role": "user", "content": [{"type": "text", "text": "ab"}, "c."]}]
    shown = {fmt: llm.chat(conversation, greedy(1), chat_template_content_format=fmt)[0].prompt
             for fmt in ("auto", "string", "openai")}
    assert shown == {"auto": "[user]ab\nc.\n[assistant]", "string": "[user]ab\nc.\n[assistant]",
                     "openai": "[user]ab|c.\n[assistant]"}
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    refusals = [
        (dict(messages=image), r"\['content'\]\[0\]: a 'image_url' part: multi-modal"),
        (dict(messages=conversation, mm_processor_kwargs={}), "mm_processor_kwargs"),
        (dict(messages=conversation, tokenization_kwargs={"add_special_tokens": True}),
         "add_special_tokens=True is not supported for chat"),
        (dict(messages=conversation, chat_template_content_format="xml"),
         "chat_template_content_format"),
        (dict(messages=[{"content": "ab"}]), r"messages\[0\]\['role'\]: must be a string"),
        (dict(messages=[conversation, []]), r"messages\[1\]: a conversation must be a "
                                            "non-empty list"),
        (dict(messages="hi"), "messages: must be a list"),
    ]
    for kwargs, message in refusals:
        with pytest.raises(ValueError, match=message):
            llm.chat(sampling_params=greedy(1), **kwargs)
    (ok,) = llm.chat(conversation, greedy(1), tokenization_kwargs={"add_special_tokens": False})
    assert ok.finished
    assert_nothing_admitted(llm)


def test_admission_refusal_in_a_batch_admits_nothing(llm):
    """A prompt the engine refuses at admission (an id outside the vocabulary) after good ones
    of every form: RequestError, and nothing of the batch runs."""
    with pytest.raises(RequestError, match=r"\[0, 384\)"):
        llm.generate(["ab", {"prompt_token_ids": IDS_A}, [TINY_VOCAB]], greedy(2))
    assert_nothing_admitted(llm)


# ---------------------------------------------------------------------------- SamplingParams

def test_sampling_params_vllm_fields_taken_or_refused(llm, tiny_cpu_model):
    """vLLM fields beyond the wire's: extra_args (plugin data; vLLM's own samplers ignore it
    too) and skip_clone are taken; detokenize, flat_logprobs, logits_processors and
    structured_outputs only at their defaults (a ValueError saying why); none is a wire field
    (the server refuses them as unknown keys, as before). clone() is a deep copy."""
    params = greedy(3, extra_args={"k": [1]}, skip_clone=True, detokenize=True,
                     flat_logprobs=False, logits_processors=[], structured_outputs=None)
    (out,) = llm.generate(IDS_A, params)
    assert out.outputs[0].token_ids == reference_greedy(tiny_cpu_model, IDS_A, 3)
    for name, value, why in [("detokenize", False, "always detokenizes"),
                             ("flat_logprobs", True, "only False"),
                             ("logits_processors", [lambda ids, x: x], "vLLM v1 refuses"),
                             ("structured_outputs", {"json": {}}, "structured outputs"),
                             ("extra_args", ["k"], "dict with string keys"),
                             ("skip_clone", 1, "boolean")]:
        with pytest.raises(SamplingParamsError, match=f"^{name}: .*{why}"):
            SamplingParams(**{name: value})
    wire = SamplingParams(extra_args={"k": 1}).to_dict()
    assert not {"extra_args", "skip_clone", "detokenize", "flat_logprobs", "logits_processors",
                "structured_outputs"} & set(wire)
    with pytest.raises(SamplingParamsError, match="unknown sampling parameter.*detokenize"):
        SamplingParams.from_dict({"detokenize": True})
    assert SamplingParams.from_dict(wire) == SamplingParams()  # extra_args is not carried
    copy = params.clone()
    assert copy == params and copy.extra_args is not params.extra_args
    copy.extra_args["k"].append(2)
    assert params.extra_args == {"k": [1]}
    with pytest.raises(TypeError):
        SamplingParams(best_of=2)  # gone from vLLM v1 as well


# -------------------------------------------------------------- the normalization on its own

def test_resolve_request_prompt_takes_vllms_positional_prompt():
    """What LLMEngine.add_request(request_id, prompt, params) will call: `prompt` may be any
    SingletonPrompt, or the engine's keywords give text, ids or messages; exactly one."""
    assert resolve_request_prompt({"prompt_token_ids": (5, 6)}) == PromptInput(
        prompt_token_ids=[5, 6])
    assert resolve_request_prompt([5, 6]).engine_kwargs() == {"prompt_token_ids": [5, 6]}
    assert resolve_request_prompt({"prompt": "hi"}).engine_kwargs() == {"prompt": "hi"}
    assert resolve_request_prompt("hi").engine_kwargs() == {"prompt": "hi"}
    assert resolve_request_prompt(prompt_token_ids=np.arange(3)).engine_kwargs() == {
        "prompt_token_ids": [0, 1, 2]}
    messages = [{"role": "user", "content": "hi"}]
    assert resolve_request_prompt(messages=messages).engine_kwargs() == {"messages": messages}
    with pytest.raises(PromptInputError, match="exactly one of.*got prompt, messages"):
        resolve_request_prompt("hi", messages=messages)
    with pytest.raises(PromptInputError, match="exactly one of"):
        resolve_request_prompt()
    with pytest.raises(PromptInputError, match="multi-modal"):
        resolve_request_prompt({"prompt": "x", "multi_modal_data": {"image": 1}})
    with pytest.raises(PromptInputError, match=r"prompt_token_ids\[0\]: .*got str"):
        resolve_request_prompt(prompt_token_ids=["5"])


def test_engine_add_request_takes_vllms_positional_form(llm, tiny_cpu_model):
    """vLLM's LLMEngine.add_request(request_id, prompt, params): every single-prompt form
    by position, the parameters by position; the engine's keywords still work; params given
    twice, or a bad prompt form, refused with nothing admitted."""
    engine = llm.engine
    params = greedy(4)
    forms = {"text": "hi there", "tokens": IDS_A, "text_dict": {"prompt": "hi there"},
             "tokens_dict": {"prompt_token_ids": IDS_B, "prompt": "ignored text"}}
    for rid, prompt in forms.items():
        engine.add_request(rid, prompt, params)
    engine.add_request("keywords", prompt_token_ids=IDS_A, sampling_params=params)
    done: dict[str, list[int]] = {}  # the deltas, concatenated
    while engine.has_unfinished_requests():
        for out in engine.step():
            done.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    text_ids = TextTokenizer().encode("hi there")
    want = {"text": text_ids, "tokens": IDS_A, "text_dict": text_ids, "tokens_dict": IDS_B,
            "keywords": IDS_A}
    for rid, prompt_ids in want.items():
        assert done[rid] == reference_greedy(tiny_cpu_model, prompt_ids, 4), rid
    with pytest.raises(RequestError, match="once"):
        engine.add_request("twice", IDS_A, params, sampling_params=params)
    with pytest.raises(RequestError, match="prompt"):
        engine.add_request("bad", {"prompt_embeds": [0.5]}, params)
    assert_nothing_admitted(llm)


def test_batching_rules_match_vllms_prompt_to_seq():
    """One string, one dict, or one non-empty list of ints is a batch of one; a list of
    anything else is a batch; [] is an empty batch; conversations the same way."""
    assert parse_prompts("ab") == [PromptInput(prompt="ab")]
    assert parse_prompts([5, 6]) == [PromptInput(prompt_token_ids=[5, 6])]
    assert parse_prompts([[5, 6]]) == [PromptInput(prompt_token_ids=[5, 6])]
    assert parse_prompts([[5], "a"]) == [PromptInput(prompt_token_ids=[5]),
                                         PromptInput(prompt="a")]
    assert parse_prompts([]) == []
    message = {"role": "user", "content": "a"}
    assert parse_conversations([message]) == [[message]]
    assert parse_conversations([[message], [message, message]]) == [[message],
                                                                     [message, message]]
    assert parse_conversations([]) == []
    assert dataclasses.is_dataclass(PromptInput)


# ------------------------------------------------------------------- a real tokenizer (default)

def test_forms_with_the_default_models_tokenizer():
    """The default model (SmolLM2-135M-Instruct, cpu) with its real tokenizer and template: a
    string, a TextPrompt and a TokensPrompt of the same ids run the same ids and give the same
    greedy tokens; a chat's RequestOutput.prompt is the template rendered with the text parts
    joined by a newline, and it tokenizes (without added specials) to the prompt's ids."""
    from pagedrun.runtime.default_model import default_model_dir
    from pagedrun.runtime.engine import LLMEngine
    from pagedrun.runtime.engine_config import EngineConfig
    from pagedrun.runtime.errors import ModelLoadError
    from pagedrun.runtime.model_config import ModelConfig
    from pagedrun.runtime.tokenizer import Tokenizer
    from pagedrun.runtime.weights import load_model_weights

    try:
        model_dir = default_model_dir(progress=False)
    except ModelLoadError as exc:  # the default model package is not installed
        pytest.skip(str(exc))
    config = ModelConfig.from_model_dir(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    engine = LLMEngine(EngineConfig(device="cpu", max_model_len=128, num_kv_blocks=32,
                                    max_num_batched_tokens=128),
                       model_config=config, weights=load_model_weights(model_dir, config),
                       tokenizer=tok)
    llm = LLM.from_engine(engine)
    text = "The capital of France is"
    ids = tok.encode(text)
    outs = llm.generate([text, {"prompt": text}, {"prompt_token_ids": ids}], greedy(3))
    assert [o.prompt_token_ids for o in outs] == [ids] * 3
    assert [o.prompt for o in outs] == [text, text, None]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == \
        outs[2].outputs[0].token_ids
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, "there"]}]
    (chat,) = llm.chat(parts, greedy(2))
    assert chat.prompt == tok.apply_chat_template([{"role": "user", "content": "Hi\nthere"}],
                                                  add_generation_prompt=True)
    assert tok.encode(chat.prompt, add_special_tokens=False) == chat.prompt_token_ids
