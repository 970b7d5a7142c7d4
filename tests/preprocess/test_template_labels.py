"""Templating + tokenization + label masks against hand-checked Qwen token ids.

Ids (Qwen2.5/Qwen3 vocabulary): 151644 <|im_start|>, 151645 <|im_end|>, 872 'user',
77091 'assistant', 8948 'system', 198 '\\n', 271 '\\n\\n', 151667 <think>, 151668 </think>,
13048 'Hi', 9707 'Hello', 0 '!', and 'You are a helpful assistant.' = 2610 525 264 10950 17847 13.
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.errors import UserError
from pipeline.preprocess import chat_template
from pipeline.preprocess.chat_template import (
    IMAGE_PLACEHOLDER,
    ContentSpan,
    RenderedChat,
    render,
    template_text,
)
from pipeline.preprocess.labels import IGNORE, assistant_spans
from pipeline.preprocess.records import parse_record
from pipeline.preprocess.sample import ProcessedSample
from pipeline.preprocess.tokenizer import load_tokenizer

from .conftest import chat, make_job, processor_for, src

M = -100
IM_START, IM_END, NL = 151644, 151645, 198


def _one(job, rec) -> ProcessedSample:
    import json

    item = processor_for(job).process_one(src(), 0, json.dumps(rec).encode())
    assert isinstance(item, ProcessedSample), item
    return item


def test_qwen3_bundled_template_ids_and_labels():
    s = _one(make_job(), chat())
    assert s.input_ids.tolist() == [
        IM_START, 872, NL, 13048, IM_END, NL,
        IM_START, 77091, NL, 151667, 271, 151668, 271, 9707, 0, IM_END, NL]
    # Trained: the assistant's answer incl. Qwen3's empty think block and <|im_end|>.
    assert s.labels.tolist() == [M] * 9 + [151667, 271, 151668, 271, 9707, 0, IM_END, M]
    assert s.input_ids.dtype == np.int32 and s.labels.dtype == np.int32
    assert s.num_tokens == s.cost == 17 and s.num_visual_tokens == 0


def test_qwen2_template_adds_default_system_and_no_think():
    s = _one(make_job(chat_template="qwen2"), chat())
    system = [IM_START, 8948, NL, 2610, 525, 264, 10950, 17847, 13, IM_END, NL]
    assert s.input_ids.tolist() == [
        *system, IM_START, 872, NL, 13048, IM_END, NL, IM_START, 77091, NL, 9707, 0, IM_END, NL]
    assert s.labels.tolist() == [M] * (len(system) + 9) + [9707, 0, IM_END, M]


def test_multi_turn_masks_every_assistant_turn_and_no_user_turn():
    rec = {"messages": [{"role": "system", "content": "S"},
                        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"},
                        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "B"}]}
    s = _one(make_job(chat_template="qwen2"), rec)
    tok = load_tokenizer(make_job().preprocess)
    trained = tok.decode(s.labels[s.labels != IGNORE].tolist())
    assert trained == "A<|im_end|>B<|im_end|>"
    # Every labelled token equals its input id (no shift here; the trainer shifts).
    lab = s.labels != IGNORE
    assert (s.labels[lab] == s.input_ids[lab]).all()


def test_content_starting_with_newlines_keeps_turn_boundaries():
    # "\n\n..." after the header BPE-merges with the header's "\n"; masks follow characters.
    s = _one(make_job(chat_template="qwen2"), chat(assistant="\n\nAnswer"))
    tok = load_tokenizer(make_job().preprocess)
    trained = tok.decode(s.labels[s.labels != IGNORE].tolist())
    assert trained.endswith("Answer<|im_end|>") and "assistant" not in trained


def test_qwen2_template_image_parts_match_inline_placeholder():
    cfg = make_job(chat_template="qwen2").preprocess
    tok = load_tokenizer(cfg)
    tmpl = template_text(cfg, tok)
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
             {"role": "assistant", "content": "Hello!"}]
    inline = [{"role": "user", "content": IMAGE_PLACEHOLDER + "Hi"},
              {"role": "assistant", "content": "Hello!"}]
    a = tok.apply_chat_template(parts, chat_template=tmpl, tokenize=False)
    b = tok.apply_chat_template(inline, chat_template=tmpl, tokenize=False)
    assert a == b and "<|vision_start|><|image_pad|><|vision_end|>Hi" in a


def test_custom_jinja_file_non_chatml(tmp_path):
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}{% if m.role == 'user' %}User: {{ m.content }}\n"
                    "{% else %}Bot: {{ m.content }}{{ eos_token }}\n{% endif %}{% endfor %}")
    s = _one(make_job(chat_template=str(path)), chat("Hi", "Hello there"))
    tok = load_tokenizer(make_job().preprocess)
    assert tok.decode(s.input_ids.tolist()) == "User: Hi\nBot: Hello there<|im_end|>\n"
    assert tok.decode(s.labels[s.labels != IGNORE].tolist()) == " Hello there<|im_end|>"


def test_a_conversation_shape_is_rendered_once_and_its_content_spliced_in():
    proc = processor_for(make_job())
    tok, tmpl = proc.tokenizer, proc.template
    chat_template._skeleton.cache_clear()
    first = render(parse_record(chat("Hi", "Hello!")), tok, tmpl)
    other = render(parse_record(chat("What now?", "Nothing.")), tok, tmpl)
    info = chat_template._skeleton.cache_info()
    assert (info.misses, info.hits) == (1, 1)  # one Jinja render for the shape
    assert first.text == tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        chat_template=tmpl, tokenize=False)
    assert other.text == tok.apply_chat_template(
        [{"role": "user", "content": "What now?"}, {"role": "assistant", "content": "Nothing."}],
        chat_template=tmpl, tokenize=False)
    assert [other.text[c.start:c.end] for c in other.content] == ["What now?", "Nothing."]
    # A template whose output may change between renders (a date) is rendered every time.
    dated = "{{ strftime_now('%Y') }}{% for m in messages %}{{ m.content }}\n{% endfor %}"
    year = render(parse_record(chat()), tok, dated)
    assert year.text.endswith("Hi\nHello!\n") and year.text[:4].isdigit()
    assert chat_template._skeleton.cache_info().currsize == 1


def test_assistant_spans_chatml_text():
    text = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\nans<|im_end|>\n"
    q, ans = text.index("q<"), text.index("ans")
    chat = RenderedChat(text, (ContentSpan(0, q, q + 1), ContentSpan(1, ans, ans + 3)),
                        ("user", "assistant"))
    (start, end), = assistant_spans(chat)
    assert text[start:end] == "ans<|im_end|>"


def test_bad_template_setting_is_a_user_error():
    with pytest.raises(UserError, match="chat_template"):
        template_text(make_job(chat_template="/no/such.jinja").preprocess,
                      load_tokenizer(make_job().preprocess))


def test_other_tokenizer_dir_loads(tmp_path):
    import shutil

    from pipeline.preprocess.tokenizer import bundled_tokenizer_dir

    copy = tmp_path / "tok"
    shutil.copytree(bundled_tokenizer_dir(), copy)
    s = _one(make_job(tokenizer_dir=str(copy)), chat())
    assert s.input_ids.tolist()[:4] == [IM_START, 872, NL, 13048]
    with pytest.raises(UserError, match="tokenizer_dir"):
        load_tokenizer(make_job(tokenizer_dir=str(tmp_path / "nope")).preprocess)


def test_max_seq_len_truncate_and_quarantine():
    long = chat(assistant="word " * 200)
    s = _one(make_job(max_seq_len=64), long)
    assert s.num_tokens == 64 and s.truncated and (s.labels != IGNORE).any()
    import json

    q = processor_for(make_job(max_seq_len=64, truncation="quarantine")).process_one(
        src(), 3, json.dumps(long).encode())
    assert q.reason == "too_long" and q.row == 3
    # Truncation that leaves no assistant token quarantines too: nothing to learn from.
    question = chat(user="word " * 200)
    q = processor_for(make_job(max_seq_len=64)).process_one(src(), 4,
                                                            json.dumps(question).encode())
    assert q.reason == "no_loss_tokens" and "no assistant token" in q.detail


def test_a_limit_below_the_template_floor_is_a_config_error():
    from pipeline.config import ConfigError
    from pipeline.preprocess.process import Processor

    # Qwen3: <|im_start|> user \n <|im_end|> \n <|im_start|> assistant \n <think>: 9 tokens.
    assert processor_for(make_job(max_seq_len=9)).max_tokens == 9
    with pytest.raises(ConfigError, match=r"preprocess.max_seq_len 8\b.*9 tokens"):
        Processor(make_job(max_seq_len=8), 0)
    with pytest.raises(ConfigError, match=r"batching\.token_budget 8"):
        Processor(make_job(batching={"token_budget": 8}), 0)
    # Under `alone` the budget does not limit a sample: only max_seq_len does.
    assert processor_for(make_job(batching={"token_budget": 8, "over_budget": "alone"})
                         ).max_tokens == 4096


def test_cost_uses_attention_model_only_when_b_positive():
    s = _one(make_job(batching={"attn_a": 2.0, "attn_b": 0.5}), chat())
    assert s.cost == 2 * 17 + 0.5 * 17 * 17 + 0.5  # ceil(178.5)
    s = _one(make_job(batching={"attn_a": 3.0, "attn_b": 0.0}), chat())
    assert s.cost == 17


def test_the_fast_tokenizer_we_load_equals_autotokenizer_without_torch():
    """load_tokenizer uses the generic fast tokenizer (AutoTokenizer would import torch in every
    process): the same ids, offsets, special tokens and chat template on real text."""
    import pydoc_data.topics
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from pipeline.config import PreprocessConfig
    from pipeline.preprocess.tokenizer import tokenizer_dir

    ours = load_tokenizer(PreprocessConfig())
    auto = AutoTokenizer.from_pretrained(tokenizer_dir(PreprocessConfig()), local_files_only=True)
    texts = [*list(pydoc_data.topics.topics.values())[:40], "naïve café 東京 🙂 <|image_pad|>x"]
    for t in texts:
        a = ours(t, return_offsets_mapping=True)
        b = auto(t, return_offsets_mapping=True)
        assert a["input_ids"] == b["input_ids"] and a["offset_mapping"] == b["offset_mapping"]
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    assert ours.apply_chat_template(msgs, tokenize=False) == auto.apply_chat_template(
        msgs, tokenize=False)
    assert (ours.eos_token, ours.pad_token, len(ours)) == (auto.eos_token, auto.pad_token,
                                                           len(auto))
    probe = ("import sys; from pipeline.config import PreprocessConfig; "
             "from pipeline.preprocess.tokenizer import load_tokenizer; "
             "load_tokenizer(PreprocessConfig()); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
